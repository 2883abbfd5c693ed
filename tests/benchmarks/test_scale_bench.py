"""Keeps ``python -m benchmarks.scale`` from rotting: a tiny run of every figure, its tables
and its chart, driving the real commit and restore code on the simulated S3."""

from __future__ import annotations

import json

from benchmarks import scale


def test_tiny_scale_run_writes_results_tables_and_chart(tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "s.png"
    argv = ["--sizes", "8,80", "--steps", "3,30", "--out", str(out), "--plot", str(png), "--write-s", "1"]
    assert scale.main(argv) == 0
    res = json.loads(out.read_text())["after"]
    for s in res["save"]:
        assert s["committed"] and s["failed_ranks"] == 0 and s["slowdowns"] == 0
        assert s["commit_latency_s"] is not None
    assert [x["requests"] for x in res["latest"]] == [3, 3]
    assert all(r["slowdowns"] == 0 for r in res["restore"])
    assert png.stat().st_size > 0
    capsys.readouterr()
    assert scale.main(["--table", "--out", str(out)]) == 0
    assert "| 80 | after | True |" in capsys.readouterr().out


def test_tiny_daemon_run_claims_once_per_daemon(tmp_path):
    """``--daemon 8``: the ranks persist as ``ckptd serve`` jobs, 8 per daemon, sharing each
    daemon's claim (the real ``commit.SharedClaim``): 10 daemons, 10 claims of the step."""
    out = tmp_path / "r.json"
    argv = ["--sizes", "80", "--only", "save", "--daemon", "8", "--out", str(out), "--write-s", "1"]
    assert scale.main(argv) == 0
    (s,) = json.loads(out.read_text())["after"]["save"]
    assert s["committed"] and s["failed_ranks"] == 0 and s["slowdowns"] == 0, s
    assert s["daemon_claims"] == 10, s


def test_the_clock_seam_covers_every_module_of_the_save_path():
    """Each module the simulated save runs that reads the clock runs on the virtual one: a module
    left out would sleep and time out in real seconds (the split of ``ckptd.commit`` moved the
    claim, the write, retention and the daemon's shared claim into modules of their own)."""
    import importlib

    path = [
        "catalog",
        "claims",
        "commit",
        "donetree",
        "latest",
        "leases",
        "persist",
        "retention",
        "server.shared_claim",
    ]
    reading = {m for m in (importlib.import_module(f"ckptd.{n}") for n in path) if hasattr(m, "time")}
    assert reading <= set(scale._protocol_modules())
    assert {m.__name__ for m in reading} >= {"ckptd.claims", "ckptd.commit", "ckptd.persist", "ckptd.retention"}
