"""The request-level partition model of ``benchmarks.scale`` (``tests.doubles.sim_requests``)
at small sizes: its bookkeeping (every request issued is counted, once accepted or once refused),
the real ``AdaptiveLimiter`` keeping a paced save from failing a PUT where the range is
overloaded, and the restore's requests as the real reader plans them. No durations asserted."""

from __future__ import annotations

import json

import numpy as np

from benchmarks import scale
from storage_backends.memory import MemoryStore
from tests.doubles.sim_requests import Client, RequestPartitionModel


def _clients(n: int, count: int) -> list[Client]:
    return [Client(count, 0.001 * i) for i in range(n)]


def test_paced_clients_over_one_partition_meet_slowdowns_and_fail_no_put():
    # 64 ranks x 16 threads at 0.16 s a PUT offer 6,400 PUT/s to a range that accepts 3,500
    model = RequestPartitionModel(rate=3500.0)
    got = model.run(_clients(64, 300))
    assert got["requests"] == 64 * 300
    assert got["tries"] == got["requests"] + got["slowdowns"]  # a PUT that failed would break this
    assert got["slowdowns"] > 0 and got["failed"] == 0 and got["clients_failed"] == 0
    assert got["waits"] > 0  # the limiters held requests back after the SlowDowns
    # the limiter's documented bound: a try waits at most (tries waiting in its scope, itself
    # included) / min_rate for its token; a client has at most 16 in flight
    assert got["max_wait_s"] <= model.threads / model.min_rate, got


def test_without_retries_every_slowdown_is_a_failed_put():
    got = RequestPartitionModel(rate=3500.0, attempts=1).run(_clients(64, 300))
    assert got["failed"] == got["slowdowns"] > 0
    assert got["tries"] == got["requests"]


def test_aggregated_clients_count_the_requests_of_the_ranks_they_stand_for():
    whole = RequestPartitionModel(rate=3500.0).run(_clients(64, 100))
    half = RequestPartitionModel(rate=3500.0, aggregate=2).run(_clients(32, 100))
    assert whole["requests"] == half["requests"] == 6400
    assert half["tries"] == half["requests"] + half["slowdowns"]
    assert half["failed"] == whole["failed"] == 0


def test_restore_reads_follow_the_reader_plan():
    n, arrays = 16, 30
    record = len(scale.done_record_bytes(n, arrays))
    for m, shards in ((n // 4, 4), (n // 2, 2), (n, 1)):
        r = scale.restore_reads(n, m, arrays)
        # a rank's shard GETs, the done records of the ranks that wrote them and its own, and on
        # rank 0 the manifest and the commit record
        assert r["per_rank_gets"] == arrays * shards + shards + 1 + 2, r
        assert r["gets"] == m * (arrays * shards + shards + 1) + 2
        assert r["per_rank_records"] == shards + 1
        assert sum(r["counts"]) == r["gets"] + r["lists"]
        assert r["record_bytes"] == record


class _CountingStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__("memory://scale-model-reads")
        self.reads = 0

    def get_range_into(self, key, start, buffers):
        self.reads += 1
        return super().get_range_into(key, start, buffers)

    def get_ranges(self, key, ranges):
        self.reads += len(ranges)
        return super().get_ranges(key, ranges)

    def get(self, key, limit=None):
        self.reads += 1
        return super().get(key, limit)


def test_restore_shard_gets_are_those_the_real_reader_sends():
    from benchmarks.pins_cost import manifest
    from ckptd.codec import encode_shard
    from ckptd.layout import Box
    from ckptd.reader import CheckpointReader, ReadRequest

    n, arrays = 8, 3
    store = _CountingStore()
    entries = list(manifest(arrays, n).tensors.values())
    for e in entries:  # every rank's shard of every array, encoded as a save writes it
        for r in range(n):
            start, stop = e.layout.shard_box((r, 0))
            block = np.zeros([b - a for a, b in zip(start, stop, strict=True)], e.layout.np_dtype)
            body = b"".join(bytes(b) for b in encode_shard(e.layout, (r, 0), block))
            store.put(f"s/{e.path}/{e.layout.shard_key((r, 0))}", body)
    rows, cols = entries[0].layout.shape
    for m in (n // 4, n // 2, n):
        most = 0
        for r in range(m):
            want = Box((r * rows // m, 0), ((r + 1) * rows // m, cols))
            store.reads = 0
            reqs = [ReadRequest(e, want, np.empty(want.shape, e.layout.np_dtype)) for e in entries]
            CheckpointReader(store, "s").read(reqs)
            most = max(most, store.reads)
        assert scale.restore_reads(n, m, arrays)["per_rank_shard_gets"] == most > 0, m


def test_restore_pins_requests_are_those_of_restore_pins_for():
    from benchmarks.pins_cost import restore_requests

    n, arrays = 256, 3
    for m in (n // 4, n):
        got = scale.restore_reads(n, m, arrays)
        real = restore_requests(arrays, n, m, m // 2)  # the real pins_for on a counting store
        # per rank, beside its shards: the writers' records it pins plus its own RNG record
        assert got["per_rank_records"] == real["done_record_gets"] + 1, (got, real)
        assert got["per_rank_lists"] == real["lists"] + 1, (got, real)


def test_partitions_run_reports_save_and_restore_with_no_failure(tmp_path):
    out = tmp_path / "r.json"
    argv = ["--realistic", "--only", "partitions", "--sizes", "64", "--arrays", "40", "--write-s", "1"]
    assert scale.main([*argv, "--out", str(out), "--label", "tiny"]) == 0
    (p,) = json.loads(out.read_text())["tiny"]["partitions"]
    assert p["save"]["requests"] == p["puts"] == 64 * 40 and p["save"]["failed"] == 0
    assert [r["m"] for r in p["restore"]] == [16, 32, 64]
    for r in p["restore"]:
        assert r["model"]["requests"] == r["gets"] + r["lists"] and r["model"]["failed"] == 0
    assert "| 64 | 2,560 |" in "\n".join(scale.partition_table({"tiny": {"partitions": [p]}}))
