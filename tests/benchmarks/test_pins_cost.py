"""A restoring rank reads the done records of the ranks that wrote what it reads: about N/M of
them (``benchmarks.pins_cost`` against a counting in-memory store), not N."""

from __future__ import annotations

from benchmarks import pins_cost


def test_a_restoring_rank_reads_n_over_m_done_records():
    for restore_at, rank in ((256, 100), (16, 3), (1, 0)):
        got = pins_cost.restore_requests(arrays=4, ranks=256, restore_at=restore_at, rank=rank)
        assert got["done_record_gets"] == 256 // restore_at, got
        assert got["lists"] == -(-256 // restore_at // 64), got  # one LIST per group of 64 ranks


def test_the_commit_check_runs_at_both_sizes():
    got = pins_cost.commit_check(arrays=3, ranks=64)
    assert got["before_cpu_s"] >= 0 and got["after_cpu_s"] >= 0


def test_the_blake3_rows_time_both_pin_formats(tmp_path):
    """``--blake3`` saves and restores with crc32c-only and with BLAKE3 pins (a smoke run: no
    duration is asserted, only that both formats were timed)."""
    from benchmarks.pins_cost import blake3_cost

    row = blake3_cost(8 << 20, 1, str(tmp_path))
    assert row["bytes"] == 8 << 20 and all(row[f"{k}_ratio"] > 0 for k in ("save", "restore"))
