"""Prometheus text exposition of the daemon's counters, without a client library.

Counters only grow; gauges are read at scrape time through callables. Thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["Metrics"]

_HELP = {
    "ckptd_jobs_accepted_total": ("counter", "snapshots handed off to this daemon"),
    "ckptd_jobs_committed_total": ("counter", "handed-off snapshots whose checkpoint committed"),
    "ckptd_jobs_failed_total": ("counter", "handed-off snapshots that failed"),
    "ckptd_jobs_discarded_total": ("counter", "snapshots discarded at restart (staging files lost)"),
    "ckptd_jobs_recovered_total": ("counter", "snapshots resumed after a restart"),
    "ckptd_commits_written_total": ("counter", "commit records this daemon wrote"),
    "ckptd_step_claims_total": (
        "counter",
        "claims of a step this daemon ran (commit.begin: ~3 requests each); one per attempt for all its ranks",
    ),
    "ckptd_bytes_written_total": ("counter", "bytes written to storage (shards and metadata)"),
    "ckptd_objects_written_total": ("counter", "objects written to storage"),
    "ckptd_upload_seconds_total": ("counter", "seconds spent uploading (sum over jobs)"),
    "ckptd_upload_retries_total": ("counter", "uploads re-run after an error"),
    "ckptd_budget_waits_total": ("counter", "staging requests refused (429) because the budget was full"),
    "ckptd_handoff_to_commit_seconds_sum": ("counter", "seconds from hand-off to commit, summed over jobs"),
    "ckptd_handoff_to_commit_seconds_count": ("counter", "jobs counted in the sum above"),
    "ckptd_uploads_aborted_total": ("counter", "stale incomplete multipart uploads aborted by housekeeping"),
    "ckptd_save_staging_seconds_sum": (
        "counter",
        "seconds from a lease's acquire to its hand-off (what save blocked on, as the daemon sees it), summed",
    ),
    "ckptd_save_staging_seconds_count": ("counter", "hand-offs counted in the sum above"),
    "ckptd_last_commit_timestamp_seconds": ("gauge", "unix time of the last commit a job of this daemon saw; 0: none"),
    "ckptd_upload_throughput_bytes_per_second": ("gauge", "the last upload's bytes per second; 0: none yet"),
}


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self._c: dict[str, float] = dict.fromkeys(_HELP, 0.0)
        self._gauges: dict[str, tuple[str, Callable[[], float]]] = {}
        self._labelled: dict[str, tuple[str, str, Callable[[], dict[str, float]]]] = {}

    def inc(self, name: str, value: float = 1.0) -> None:
        with self._lock:
            self._c[name] += value

    def set_last(self, name: str, value: float) -> None:
        """A gauge of ``_HELP`` that holds the latest observation (e.g. the last upload's
        throughput); rendered from the start (0 until set), so dashboards and alerts find it."""
        with self._lock:
            self._c[name] = value

    def gauge(self, name: str, help_text: str, fn: Callable[[], float]) -> None:
        self._gauges[name] = (help_text, fn)

    def labelled(self, name: str, help_text: str, label: str, fn: Callable[[], dict[str, float]]) -> None:
        """A gauge with one sample per ``label`` value (``fn`` bounds how many)."""
        self._labelled[name] = (help_text, label, fn)

    def render(self) -> str:
        with self._lock:
            counters = dict(self._c)
        lines: list[str] = []
        for name, (kind, text) in _HELP.items():
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {_num(counters[name])}"]
        for name, (text, fn) in self._gauges.items():
            lines += [f"# HELP {name} {text}", f"# TYPE {name} gauge", f"{name} {_num(fn())}"]
        for name, (text, label, many) in self._labelled.items():
            lines += [f"# HELP {name} {text}", f"# TYPE {name} gauge"]
            lines += [f'{name}{{{label}="{_label(k)}"}} {_num(v)}' for k, v in many().items()]
        return "\n".join(lines) + "\n"


def _label(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))
