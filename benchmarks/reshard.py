"""Resharding rows: an FSDP2 state saved at 4 ranks, restored at 3 and at 2 (gloo on CPU, real
processes), ckptd against DCP and against the raw floor at the same world size."""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

from benchmarks import dist
from benchmarks.results import ERROR, Results

SECTION = "reshard"
SAVE_WORLD = 4
RESTORE_WORLDS = (3, 2)


def run(res: Results, size: int, reps: int, bench_dir: str, profile_prefix: str | None = None) -> None:
    work = os.path.join(bench_dir, "reshard")
    logs = Path(bench_dir) / "reshard_logs"
    os.makedirs(work, exist_ok=True)
    sec = res.sections.setdefault(SECTION, {"save_world": SAVE_WORLD, "restore_worlds": list(RESTORE_WORLDS)})
    w = SAVE_WORLD

    def R(id, label, floor=None, dcp_ref=None, unit="s"):  # noqa: N802
        return res.row(id, SECTION, label, floor=floor, dcp=dcp_ref, unit=unit)

    R(f"reshard.save{w}.raw", f"raw write + fsync, {w} ranks in parallel (floor)")
    R(f"reshard.save{w}.ckptd.block", f"ckptd save at {w} ranks: time save() blocks")
    R(f"reshard.save{w}.dcp", f"dcp.save at {w} ranks", floor=f"reshard.save{w}.raw")
    R(f"reshard.save{w}.ckptd.commit", f"ckptd save at {w} ranks: until committed", floor=f"reshard.save{w}.raw",
      dcp_ref=f"reshard.save{w}.dcp")  # fmt: skip
    try:
        saved = dist.run(w, "save", logs, size=size, dir=work, reps=reps)
    except RuntimeError as e:
        for r in list(res.rows.values()):
            if r.section == SECTION:
                r.status, r.note = ERROR, str(e)[:2000]
        shutil.rmtree(work, ignore_errors=True)
        return
    t = saved[0]["times"]
    for rep in range(reps):
        res.add(f"reshard.save{w}.raw", rep, t["raw"][rep])
        res.add(f"reshard.save{w}.ckptd.block", rep, t["ckptd.block"][rep])
        res.add(f"reshard.save{w}.ckptd.commit", rep, t["ckptd.commit"][rep])
        res.add(f"reshard.save{w}.dcp", rep, t["dcp.save"][rep])
    sec["state_bytes"] = sum(s["local_bytes"] for s in saved)
    sec["model"] = saved[0]["model"]
    saved_check = saved[0]["checksum"]
    sec["checks"] = {"saved": saved_check}

    for m in RESTORE_WORLDS:
        base = f"reshard.restore{m}"
        R(f"{base}.raw", f"raw cold read at {m} ranks (each reads 1/{m} of the bytes; floor)")
        R(f"{base}.dcp", f"dcp.load at {m} ranks (cold) + set_state_dict", floor=f"{base}.raw")
        R(f"{base}.ckptd", f"ckptd restore at {m} ranks (cold)", floor=f"{base}.raw", dcp_ref=f"{base}.dcp")
        R(f"{base}.ckptd_inplace", f"ckptd restore(in_place=True) at {m} ranks (cold): DCP's semantics",
          floor=f"{base}.raw", dcp_ref=f"{base}.dcp")  # fmt: skip
        for s in ("raw", "dcp", "ckptd"):
            R(f"{base}.bytes.{s}", f"{s}: bytes read / bytes restored at {m} ranks (rchar)", unit="x")
        prof = f"{profile_prefix}_restore{m}" if profile_prefix else ""
        try:
            got = dist.run(
                m,
                "restore",
                logs,
                size=size,
                dir=work,
                reps=reps,
                dcp_dir=saved[0]["dcp_dir"],
                raw_sizes=[s["raw_bytes"] for s in saved],
                profile=prof,
            )
        except RuntimeError as e:
            for r in list(res.rows.values()):
                if r.id.startswith(base):
                    r.status, r.note = ERROR, str(e)[:2000]
            continue
        for s in ("raw", "dcp", "ckptd", "ckptd_inplace"):
            for rep in range(reps):
                per_rank = [g["rows"][s][rep] for g in got]
                res.add(f"{base}.{s}", rep, per_rank[0]["time"])
                if s == "ckptd_inplace":
                    continue
                restored = sum(p["restored"] for p in per_rank)
                res.add(f"{base}.bytes.{s}", rep, sum(p["rchar"] for p in per_rank) / restored)
                # read_bytes: what the disk delivered; ranks share one page cache here, so bytes two
                # ranks both read are counted once -- kept for reference, not the figure
                res.rows[f"{base}.bytes.{s}"].extra.setdefault("read_bytes_ratio", []).append(
                    sum(p["read_bytes"] for p in per_rank) / restored
                )
        checks = got[0]["checks"]
        sec["checks"][f"restore{m}"] = checks
        bad = [k for k, v in checks.items() if not math.isclose(v, saved_check, rel_tol=1e-9)]
        if bad:
            res.notes.append(f"resharding at {m} ranks: {bad} restored values that differ from the saved ones")
        if got[0].get("profile"):
            sec.setdefault("profiles", {})[f"restore{m}"] = got[0]["profile"]
    shutil.rmtree(work, ignore_errors=True)
