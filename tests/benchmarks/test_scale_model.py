"""The request-level partition model of ``benchmarks.scale`` (``tests.doubles.sim_requests``)
at small sizes: its bookkeeping (every request issued is counted, once accepted or once refused),
the real ``AdaptiveLimiter`` keeping a paced save from failing a PUT where the range is
overloaded, and the restore's requests as the real reader plans them. No durations asserted."""

from __future__ import annotations

import json

from benchmarks import scale
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
