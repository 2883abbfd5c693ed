"""Keeps the benchmark suite from rotting: the planning micro-benchmark and one tiny in-process
row run end to end, and their output has the structure the report and the JSON rely on. No
assertion on durations: this machine's timings are noise."""

from __future__ import annotations

import json

from benchmarks import gpu, inproc, planning, report, targets
from benchmarks.common import MiB, parse_size, rotate
from benchmarks.results import OK, Results


def test_parse_size():
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size("64MiB") == 64 * MiB
    assert parse_size("512M") == 512 * MiB
    assert parse_size("100") == 100


def test_planning_microbenchmark_structure():
    res = Results()
    sec = planning.run(res, ranks=64, tensors=20, per_key_sample=3, grid_ranks=(16, 64), grid_tensors=(10, 20))
    res.finalize()
    for rid in ("planning.reads", "planning.read_cost", "planning.writes_per_signature", "planning.save_path"):
        row = res.rows[rid]
        assert row.status == OK
        assert len(row.values) == 1 and row.median is not None and row.median >= 0
    assert res.rows["planning.reads"].extra["chunks"] > 0
    assert {(g["ranks"], g["tensors"]) for g in sec["grid"]} == {(16, 10), (16, 20), (64, 10), (64, 20)}
    assert set(sec["grid"][0]) == {"ranks", "tensors", "plan_reads_s", "chunks", "plan_writes_per_sig_s"}
    assert sec["reads_growth_over_ranks"] is not None
    ts = {t.id: t for t in targets.evaluate(res, None)}
    assert ts["planning.reads"].value is not None and ts["planning.reads"].verdict in ("PASS", "FAIL")


def test_tiny_inprocess_row(tmp_path):
    res = Results()
    bench = tmp_path / "bench"
    bench.mkdir()
    inproc.run(res, 4 * MiB, 1, str(bench), lambda system: system in ("floor", "ckptd"))
    res.finalize()
    sec = res.sections["local"]
    assert sec["failures"] == []
    assert 0 < sec["state_bytes"] < 8 * MiB
    for rid in ("floor.memcpy", "floor.write", "floor.read", "ckptd.block", "ckptd.commit", "ckptd.restore",
                "ckptd.restore_fresh", "ckptd.import_restore_fresh"):  # fmt: skip
        row = res.rows[rid]
        assert row.status == OK, (rid, row.note)
        assert list(row.values) == [0] and row.min == row.median > 0
    assert res.rows["ckptd.block"].floor == "floor.memcpy"
    assert res.rows["ckptd.block"].ratio_floor is not None
    assert res.rows["ckptd.commit"].ratio_floor is not None
    assert res.rows["ckptd.restore"].ratio_floor is not None
    assert res.rows["ckptd.restore_fresh"].extra["page_faults"][0] > 0  # measured in the child process
    assert res.rows["dcp.load_fresh"].values == {}  # dcp not selected
    imp = res.rows["ckptd.import_restore_fresh"]  # the import, timed in the child, comes on top
    assert imp.median > res.rows["ckptd.restore_fresh"].median
    assert res.rows["ckptd.block"].extra["staged_bytes"] > 0
    assert res.rows["dcp.save"].values == {}  # not selected: no figure, no crash
    assert res.rows["ckptd.daemon.block"].status != OK  # not selected: says so
    ts = {t.id: t for t in targets.evaluate(res, None)}
    assert ts["save.block.floor"].value is not None
    assert ts["save.block.dcp"].value is None and ts["save.block.dcp"].verdict == "n/a"

    data = json.loads(json.dumps(res.to_json(), default=str))
    assert {"meta", "rows", "targets", "sections", "notes"} <= set(data)
    assert {"id", "median", "min", "ratio_floor", "ratio_dcp", "values", "status"} <= set(data["rows"][0])
    text = report.table(res)
    assert "ckptd.block" in text and "targets:" in text
    md = tmp_path / "RESULTS.md"
    report.write_markdown(res, str(md), None)
    body = md.read_text()
    assert "## Targets" in body and "`ckptd.restore`" in body and report.ANALYSIS_BEGIN in body
    assert not any(bench.iterdir())  # the row cleans up after itself


def test_gpu_rows_run_on_cpu_tensors_and_skip_without_cuda(tmp_path):
    """The GPU harness on CPU tensors (no pinning, no streams): every ckptd and DCP row gets a
    figure and the scratch folder is left clean. Without CUDA, the default says why it is empty."""
    res = Results()
    gpu.run(res, 4 * MiB, 1, str(tmp_path), device="cpu")
    res.finalize()
    for rid in ("gpu.floor.d2h", "gpu.ckptd.block", "gpu.ckptd.stall", "gpu.ckptd.commit", "gpu.dcp.default.block"):
        row = res.rows[rid]
        assert row.status == OK and list(row.values) == [0] and row.median > 0, (rid, row.note)
    assert res.rows["gpu.ckptd.stall"].ratio_floor is not None
    assert res.rows["gpu.ckptd.block"].ratio_dcp is not None
    assert res.rows["gpu.dcp.pinned.block"].status != OK  # pinned staging needs CUDA
    assert res.sections["gpu"]["device"] == "cpu"
    assert not list(tmp_path.iterdir())
    import torch

    if not torch.cuda.is_available():
        empty = Results()
        gpu.run(empty, 4 * MiB, 1, str(tmp_path))
        assert {r.status for r in empty.rows.values()} == {"skipped"}
        assert "no CUDA device" in empty.rows["gpu.ckptd.stall"].note


def test_interleaving_gives_each_system_different_neighbours():
    items = list("ABCDE")
    orders = [rotate(items, k) for k in range(4)]
    assert all(sorted(o) == items for o in orders)
    before = {x: {o[o.index(x) - 1] for o in orders if o.index(x) > 0} for x in items}
    assert all(len(b) >= 2 for b in before.values()), before  # a plain rotation gives one each
    assert {o[0] for o in orders} == {"A", "E", "B", "D"}


def test_tier_floors_and_memory_only_rows(tmp_path, monkeypatch):
    """The tiers section's floors (a loopback socket copy, received whole into the preallocated
    buffer) and the memory-only step rows at 1 rank (a real daemon: step 3 memory-only, step 1
    committed, both read from the daemon only, bitwise), judged by their targets."""
    import torch

    from benchmarks import tiers

    ts = [torch.arange(n, dtype=torch.float32) for n in (3, 1000, 70000)]
    buf = torch.zeros(sum(t.numel() * 4 for t in ts), dtype=torch.uint8)
    assert tiers._socket_copy(ts, buf) == buf.numel()
    assert torch.equal(buf, torch.cat([tiers._bytes(t) for t in ts]))

    monkeypatch.setenv("CKPTD_TOKEN", tiers.TOKEN)
    res = Results()
    for k in ("hot", "memonly"):
        res.row(f"tiers.mem1.{k}", "tiers", k)
    sec: dict = {}
    tiers._run_memsteps(res, 4 * MiB, 2, tmp_path / "mem1", 1, sec)
    res.finalize()
    assert res.notes == []
    for k in ("hot", "memonly"):
        assert sorted(res.rows[f"tiers.mem1.{k}"].values) == [0, 1]
        assert sec[f"mem1_{k}_restore_tiers"]["local"] > 0
    t = {t.id: t for t in targets.evaluate(res, None)}["tiers.memonly1"]
    assert t.value is not None and t.verdict in ("PASS", "FAIL")
