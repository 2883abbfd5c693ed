"""deploy/grafana: the dashboard and the alert rules query only metrics that a real daemon's
``/metrics`` serves, counters only through rate()/increase(), gauges never; and the metrics the
dashboard added (time save blocked, last commit time) move when a real hand-off commits."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from tests.server.daemon import ROOT, Daemon, wait_for

DASHBOARD = ROOT / "deploy" / "grafana" / "ckptd.json"
ALERTS = ROOT / "deploy" / "grafana" / "alerts.yaml"
NAME = re.compile(r"\bckptd_[a-z0-9_]+\b")


def _dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    exprs = []
    for p in dash["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        assert set(p["gridPos"]) == {"x", "y", "w", "h"}, p["title"]
        exprs += [t["expr"] for t in p["targets"]]
    return exprs


def _alert_rules() -> list[dict]:
    doc = yaml.safe_load(ALERTS.read_text())
    rules = [r for g in doc["groups"] for r in g["rules"]]
    for r in rules:
        assert r["alert"] and r["expr"] and r["labels"]["severity"] and r["annotations"]["summary"], r
    return rules


def _metric_types(text: str) -> dict[str, str]:
    return dict(m.groups() for m in re.finditer(r"^# TYPE (\S+) (\S+)$", text, re.M))


def _commit_once(url: str, root: str) -> None:
    """A real save through the daemon (the trainer's client, world size 1) that commits."""
    import torch

    from trainer_hooks import Checkpointer

    with Checkpointer(root, daemon=url) as ck:
        ck.save(1, {"w": torch.arange(4, dtype=torch.float32)}).result()


@pytest.mark.timeout(180)
def test_every_queried_metric_is_served(tmp_path):
    exprs = _dashboard_exprs()
    rules = _alert_rules()
    alerts = {r["alert"] for r in rules}
    assert {"CkptdNoCommit", "CkptdSaveFailed"} <= alerts
    root = str(tmp_path / "jobs")
    with Daemon([root], tmp_path / "staging", tmp_path / "daemon.log") as d, d.client() as c:
        types = _metric_types(c.get("/metrics").text)  # a fresh daemon: nothing saved yet
        assert d.metric("ckptd_last_commit_timestamp_seconds") == 0
        _commit_once(d.socket_url, root)
        wait_for(lambda: d.metric("ckptd_last_commit_timestamp_seconds") > 0, "the last-commit gauge", 30)
        assert d.metric("ckptd_save_staging_seconds_count") == 1
        assert d.metric("ckptd_handoff_to_commit_seconds_count") == 1
    queried = set()
    for expr in exprs + [r["expr"] for r in rules]:
        assert expr.count("(") == expr.count(")"), expr
        for name in NAME.findall(expr):
            queried.add(name)
            assert name in types, f"{name} (in {expr!r}) is not in /metrics"
            wrapped = re.search(rf"\b(rate|increase)\(\s*{name}\b", expr) is not None
            if types[name] == "counter":
                assert wrapped, f"counter {name} must go through rate()/increase(): {expr!r}"
            else:
                assert not wrapped, f"gauge {name} must not go through rate()/increase(): {expr!r}"
    # the dashboard covers saves, bytes, block and commit times, queue, staging, failures, retries
    for name in (
        "ckptd_jobs_committed_total",
        "ckptd_bytes_written_total",
        "ckptd_save_staging_seconds_sum",
        "ckptd_handoff_to_commit_seconds_sum",
        "ckptd_queue_depth",
        "ckptd_staged_bytes",
        "ckptd_staging_budget_bytes",
        "ckptd_jobs_failed_total",
        "ckptd_upload_retries_total",
    ):
        assert name in queried, name
