"""Retention's delete at loopback (issue 31): ``S3Store.purge`` of a many-key checkpoint on a real
moto server, its DeleteObjects batches one at a time (``delete_workers=1``, what ``purge`` did
before) against ``delete_workers=4`` (the default), directly and through ``FaultProxy`` holding
every DeleteObjects ``--rtt`` seconds (a round trip nearer AWS's than loopback's).

    python -m benchmarks.scale_purge --keys 8000 --rtt 0.1

Prints one JSON line per run: keys, workers, the round trip added, DeleteObjects sent, the
purge's seconds (its LIST pages included: moto lists slowly, seconds for 8000 keys) and its
DeleteObjects phase's (first sent to last answered). moto handles a
batch in one Python process, so at loopback the gain is bounded by its CPU; with a round trip it
is what overlapping round trips gives.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from storage_backends.s3 import S3Store
from tests.doubles.faults import FaultPlan, FaultProxy, Rule
from tests.s3server import CREDENTIALS, start_moto_server, stop


def _fill(store: S3Store, keys: int) -> None:
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: store.put(f"step_1/arrays/w/c/{i}", b"x"), range(keys)))


def run(url: str, keys: int, workers: int, rtt: float) -> dict:
    bucket = f"purge-{uuid.uuid4().hex[:12]}"
    with S3Store(bucket, "job", endpoint_url=url) as direct:
        direct._client.create_bucket(Bucket=bucket)
        _fill(direct, keys)
    plan = FaultPlan(delay_s=rtt, rules=[Rule(lambda r: r.op == "DeleteObjects", "delay", times=10**6)])
    with FaultProxy(url, plan) as proxy:
        target = proxy.url if rtt > 0 else url
        with S3Store(bucket, "job", endpoint_url=target, delete_workers=workers) as store:
            # the DeleteObjects phase: from the first one sent to the last one answered
            marks: list[float] = []
            events = store._client.meta.events
            events.register("before-send.s3.DeleteObjects", lambda **_: marks.append(time.perf_counter()))
            events.register("after-call.s3.DeleteObjects", lambda **_: marks.append(time.perf_counter()))
            t0 = time.perf_counter()
            deleted, _ = store.purge("step_1/")
            seconds = time.perf_counter() - t0
            assert deleted == keys and not list(store.list("step_1/"))
        sent = proxy.counters["op:DeleteObjects"] if rtt > 0 else (keys + 999) // 1000
    return {
        "keys": keys,
        "workers": workers,
        "rtt_s": rtt,
        "delete_objects": sent,
        "purge_s": round(seconds, 3),
        "deletes_s": round(max(marks) - min(marks), 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", type=int, default=8000)
    p.add_argument("--rtt", type=float, default=0.1, help="seconds the proxy holds each DeleteObjects")
    p.add_argument("--repeat", type=int, default=1)
    args = p.parse_args(argv)
    os.environ.update(CREDENTIALS)
    proc, url = start_moto_server()
    try:
        for _ in range(args.repeat):
            for rtt in (0.0, args.rtt):
                for workers in (1, 4):
                    print(json.dumps(run(url, args.keys, workers, rtt)), flush=True)
    finally:
        stop(proc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
