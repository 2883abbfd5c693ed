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
