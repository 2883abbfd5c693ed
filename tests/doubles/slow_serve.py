"""``ckptd serve`` with slowed stores, for the tests that kill a daemon in the middle of its
uploads or need a slow peer (``tests.server.daemon.Daemon(upload_delay_s=..., tier_delay_s=...)``):

    python -m tests.doubles.slow_serve [--upload-delay S] [--tier-delay S] [--push-delay STEP:S]
        [--no-backpressure] serve ARGS...

runs the real ``ckptd`` CLI (``ckptd.cli.main``) with ``ARGS`` in this process, after

- ``--upload-delay``: every job root store the daemon opens (``Roots.open_store``) is wrapped in
  :class:`SlowShardPuts`: each put of a shard object (a key under ``arrays/``) sleeps first;
- ``--tier-delay``: every read of the memory tier's held copies (``Tiers.read``, ``read_many``,
  ``shared``: the HTTP tier routes and the data path) sleeps first, once per request: a slow peer;
- ``--push-delay STEP:S``: every push of a copy of step STEP to a peer (``Replication._push``)
  sleeps first: its replica stays in flight.
- ``--no-backpressure``: memory-only hand-offs never wait for older steps' replicas
  (``Tiers.backpressure`` does nothing): the baseline ``benchmarks.backpressure`` compares with.

Nothing else changes: the daemon parses its flags, listens, hands off and commits as it does
outside the tests. The sleeps are real, so a test can SIGKILL the daemon while they last.
"""

from __future__ import annotations

import argparse
import functools
import sys
import threading
import time

from ckptd import manifest as mf
from ckptd.cli.main import main as ckptd_main
from ckptd.server.replication import Replication
from ckptd.server.roots import Roots
from ckptd.server.tiers import Tiers
from storage_backends import Store

__all__ = ["SlowShardPuts", "main"]


class SlowShardPuts:
    """A store whose puts of shard objects (keys under ``arrays/``) sleep ``delay_s`` first; every
    other call goes straight to ``store`` (a wrapper, as zarr's ``LatencyStore``)."""

    def __init__(self, store: Store, delay_s: float):
        self._store, self._delay_s = store, delay_s

    def _wait(self, key: str) -> None:
        if f"/{mf.ARRAYS}/" in key:
            time.sleep(self._delay_s)

    def put(self, key, data):
        self._wait(key)
        return self._store.put(key, data)

    def put_deferred(self, key, data):
        self._wait(key)
        return self._store.put_deferred(key, data)

    def put_new(self, key, data):
        self._wait(key)
        return self._store.put_new(key, data)

    def __getattr__(self, name):
        return getattr(self._store, name)


def slow_uploads(delay_s: float) -> None:
    """Every root store this process's daemon opens puts shard objects ``delay_s`` late."""
    opened = Roots.open_store

    @functools.wraps(opened)
    def open_store(self, uri: str, owner=None):
        return SlowShardPuts(opened(self, uri, owner), delay_s)

    Roots.open_store = open_store


def slow_tier_reads(delay_s: float) -> None:
    """Every request for held tier objects waits ``delay_s`` before it is read (a slow peer);
    ``read_many`` waits once, not once per range it reads."""
    inside = threading.local()

    def slowed(fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            if getattr(inside, "batch", False):
                return fn(self, *args, **kwargs)
            time.sleep(delay_s)
            inside.batch = True
            try:
                return fn(self, *args, **kwargs)
            finally:
                inside.batch = False

        return wrapper

    for name in ("read", "read_many", "shared"):
        setattr(Tiers, name, slowed(getattr(Tiers, name)))


def slow_pushes(step: int, delay_s: float) -> None:
    """Every push of a copy of ``step`` to a peer waits ``delay_s`` before it sends anything."""
    push = Replication._push

    @functools.wraps(push)
    def slowed(self, peer, copy):
        if copy.step == step:
            time.sleep(delay_s)
        return push(self, peer, copy)

    Replication._push = slowed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.doubles.slow_serve", allow_abbrev=False)
    parser.add_argument("--upload-delay", type=float, default=0.0, help="seconds before each shard put")
    parser.add_argument("--tier-delay", type=float, default=0.0, help="seconds before each tier read request")
    parser.add_argument("--push-delay", default="", help="STEP:SECONDS: each push of that step's copies sleeps first")
    parser.add_argument("--no-backpressure", action="store_true", help="hand-offs never wait for replicas")
    ours, rest = parser.parse_known_args(argv)
    if ours.no_backpressure:
        Tiers.backpressure = lambda self, *args: None
        print("slow_serve: memory-only hand-offs never wait for replicas", file=sys.stderr, flush=True)
    if ours.upload_delay > 0:
        slow_uploads(ours.upload_delay)
        print(f"slow_serve: every shard put sleeps {ours.upload_delay} s", file=sys.stderr, flush=True)
    if ours.tier_delay > 0:
        slow_tier_reads(ours.tier_delay)
        print(f"slow_serve: every tier read request sleeps {ours.tier_delay} s", file=sys.stderr, flush=True)
    if ours.push_delay:
        step, delay = ours.push_delay.split(":")
        slow_pushes(int(step), float(delay))
        print(f"slow_serve: every push of step {step} sleeps {delay} s", file=sys.stderr, flush=True)
    return ckptd_main(rest)


if __name__ == "__main__":
    sys.exit(main())
