"""The issue's targets, judged on one run's ratios.

Time ratios are "system time / floor time" (lower is better); a target written as a throughput
("restore >= 0.9x the read floor") is judged on floor time / system time, so 0.9 means 11% slower
than the floor. Each target names the profile (benchmarks/profiles/) that explains it when it
fails.
"""

from __future__ import annotations

import os

from benchmarks.common import median
from benchmarks.results import Results, Target


def _inv(x: float | None) -> float | None:
    return None if not x else 1.0 / x


def evaluate(res: Results, profiles_dir: str | None) -> list[Target]:
    rows = res.rows

    def ratio(id: str, which: str = "floor") -> float | None:
        r = rows.get(id)
        if r is None:
            return None
        return r.ratio_floor if which == "floor" else r.ratio_dcp

    def med(id: str) -> float | None:
        r = rows.get(id)
        return r.median if r else None

    def prof(name: str) -> str | None:
        if not profiles_dir:
            return None
        p = os.path.join(profiles_dir, name)
        return p if os.path.exists(p) else None

    best_dcp = None
    for v in ("default", "sync_cached", "shm_cached", "async_cached"):
        x = ratio(f"dcp.async.{v}.block")
        if x is not None and (best_dcp is None or x < best_dcp[1]):
            best_dcp = (v, x)
    T = []  # noqa: N806
    T.append(Target(
        "save.block.floor", "time `save` blocks <= 1.2x the memcpy floor", ratio("ckptd.block"), 1.2, "<=",
        detail=f"best DCP async_save option: {best_dcp[0]} at {best_dcp[1]:.2f}x the floor" if best_dcp else "",
        profile=prof("local_ckptd_save_block.txt")))  # fmt: skip
    T.append(Target("save.block.dcp", "time `save` blocks <= 0.5x DCP's default async_save (until safe to mutate)",
                    ratio("ckptd.block", "dcp"), 0.5, "<=", profile=prof("local_ckptd_save_block.txt")))  # fmt: skip
    T.append(Target("save.commit.floor", "time to commit on local disk <= 1.1x the write+fsync floor",
                    ratio("ckptd.commit"), 1.1, "<=", profile=prof("local_ckptd_save.txt")))  # fmt: skip
    T.append(Target("save.commit.dcp", "time to commit faster than dcp.save (ratio < 1)", ratio("ckptd.commit", "dcp"),
                    1.0, "<", profile=prof("local_ckptd_save.txt")))  # fmt: skip

    def per_rep(a: str, b: str) -> float | None:
        """The median over repetitions of row ``a``'s time / row ``b``'s in the same repetition."""
        ra, rb = rows.get(a), rows.get(b)
        if ra is None or rb is None:
            return None
        return median(ra.values[k] / rb.values[k] for k in ra.values if rb.values.get(k))

    # issue 17: the daemon path at the floor, and the default (transactional) restore at 1 rank
    T.append(Target("daemon.block.floor", "through the daemon, time `save` blocks <= 1.2x the memcpy floor",
                    ratio("ckptd.daemon.block"), 1.2, "<=",
                    detail=f"in-process save: {ratio('ckptd.block') or float('nan'):.2f}x"))  # fmt: skip
    T.append(Target("daemon.commit.inproc", "through the daemon, time to commit <= 1.1x the in-process save's "
                    "(same repetition)", per_rep("ckptd.daemon.commit", "ckptd.commit"), 1.1, "<="))  # fmt: skip
    ip1 = _inv(ratio("ckptd.restore_inplace"))
    T.append(Target("restore1.floor", "default restore at 1 rank >= 0.9x the raw read floor (floor time / "
                    "restore time)", _inv(ratio("ckptd.restore")), 0.9, ">=",
                    detail=f"restore(in_place=True): {ip1:.2f}x" if ip1 else "",
                    profile=prof("local_ckptd_restore.txt")))  # fmt: skip
    T.append(Target("restore1.dcp", "default restore at 1 rank <= 0.8x dcp.load", ratio("ckptd.restore", "dcp"),
                    0.8, "<=", profile=prof("local_ckptd_restore.txt")))  # fmt: skip
    T.append(Target("restore1.fresh.floor", "default restore at 1 rank in a fresh process (a restarting job) "
                    ">= 0.9x the raw read floor", _inv(ratio("ckptd.restore_fresh")), 0.9, ">="))  # fmt: skip
    T.append(Target("restore1.fresh.dcp", "default restore at 1 rank in a fresh process <= 0.8x dcp.load in a "
                    "fresh process", ratio("ckptd.restore_fresh", "dcp"), 0.8, "<="))  # fmt: skip
    T.append(Target("restore1.fresh.import", "import + default restore at 1 rank in a fresh process, cold, <= 0.8x "
                    "DCP's import + dcp.load", ratio("ckptd.import_restore_fresh", "dcp"), 0.8, "<="))  # fmt: skip
    for m in (3, 2):
        ip = f"reshard.restore{m}.ckptd_inplace"
        ip_floor, ip_dcp = _inv(ratio(ip)), ratio(ip, "dcp")
        T.append(Target(f"restore{m}.floor", f"restore at {m} ranks (saved at 4) >= 0.9x the raw read floor "
                        f"(floor time / restore time)", _inv(ratio(f"reshard.restore{m}.ckptd")), 0.9, ">=",
                        detail=f"restore(in_place=True): {ip_floor:.2f}x" if ip_floor else "",
                        profile=prof(f"reshard_ckptd_restore{m}.txt")))  # fmt: skip
        T.append(Target(f"restore{m}.dcp", f"restore at {m} ranks <= 0.8x dcp.load at {m} ranks",
                        ratio(f"reshard.restore{m}.ckptd", "dcp"), 0.8, "<=",
                        detail=f"restore(in_place=True), dcp.load's semantics: {ip_dcp:.2f}x" if ip_dcp else "",
                        profile=prof(f"reshard_ckptd_restore{m}.txt")))  # fmt: skip
    T.append(Target("restore3.bytes", "bytes read / bytes restored <= 1.05 restoring at 3 ranks what 4 saved",
                    med("reshard.restore3.bytes.ckptd"), 1.05, "<=",
                    detail=f"DCP: {med('reshard.restore3.bytes.dcp') or float('nan'):.2f}x; raw floor (method "
                    f"check): {med('reshard.restore3.bytes.raw') or float('nan'):.3f}x"))  # fmt: skip

    for s3, server in (("s3", "moto"), ("rgw", "Ceph RGW")):
        T.append(Target(f"{s3}.save", f"S3 save ({server}) >= 0.9x boto3 moving the same bytes as 16 MiB objects "
                        "on 16 threads (floor time / save time)", _inv(ratio(f"{s3}.ckptd.save")), 0.9, ">=",
                        profile=prof(f"{s3}_ckptd_save.txt")))  # fmt: skip
        T.append(Target(f"{s3}.restore", f"S3 restore ({server}) >= 0.9x boto3 moving the same bytes as 16 MiB "
                        "objects on 16 threads (floor time / restore time)", _inv(ratio(f"{s3}.ckptd.restore")), 0.9,
                        ">=", profile=prof(f"{s3}_ckptd_restore.txt")))  # fmt: skip
    mem = rows.get("memory.ckptd")
    T.append(Target("memory.peak", "host memory of async saves <= 1x the state on top of model + optimizer (peak)",
                    mem.extra.get("max") if mem else None, 1.0, "<=",
                    detail=f"DCP default: {rows['memory.dcp_default'].extra.get('max', float('nan')):.2f}x"
                    if "memory.dcp_default" in rows else ""))  # fmt: skip
    T.append(Target("memory.flat", "... and flat across the consecutive saves (RSS growth / state <= 0.05)",
                    med("memory.ckptd.growth"), 0.05, "<="))  # fmt: skip
    T.append(Target("planning.reads", "restore plan for one of 4096 simulated ranks x 1000 tensors < 1 s",
                    med("planning.reads"), 1.0, "<"))  # fmt: skip
    pl = res.sections.get("planning", {})
    g = pl.get("reads_growth_over_ranks")
    T.append(Target("planning.reads.scaling", f"restore planning does not grow with ranks (time ratio over "
                    f"{pl.get('ranks_growth', 8):.0f}x more ranks <= 2)", g, 2.0, "<="))  # fmt: skip
    T.append(Target("planning.writes", "save planning for 4096 ranks x 1000 tensors < 1 s per rank "
                    "(nothing O(ranks x tensors))", med("planning.save_path"), 1.0, "<",
                    detail=f"per distinct signature: {med('planning.writes_per_signature') or float('nan'):.2f} s",
                    profile=(pl.get("profile") or {}).get("summary")))  # fmt: skip
    T.append(Target("incremental.bytes", "incremental saves, 90% of bytes frozen: bytes written per save <= 15%",
                    med("incremental.bytes"), 0.15, "<="))  # fmt: skip
    silent = med("tiers.silent") - med("tiers.local") if med("tiers.silent") and med("tiers.local") else None
    T.append(Target("tiers.silent", "a SIGSTOPped peer adds <= 1 s to a restore from the tiers (seconds added, "
                    "median)", silent, 1.0, "<=", detail=f"{ratio('tiers.silent') or float('nan'):.2f}x the "
                    "restore with every peer answering"))  # fmt: skip
    T.append(Target("tiers.peer", "restore after a node loss from peers' memory <= 0.3x the S3 restore's time",
                    ratio("tiers.peer"), 0.3, "<=",
                    detail=f"local disk: {ratio('tiers.disk') or float('nan'):.2f}x, "
                    f"dcp.load: {ratio('tiers.dcp') or float('nan'):.2f}x of the S3 restore"))  # fmt: skip
    T.append(Target("tiers.local.memcpy", "restore from this node's daemon's memory >= 0.5x the memcpy floor "
                    "(floor time / restore time, same repetition)", _inv(per_rep("tiers.local", "tiers.memcpy")),
                    0.5, ">="))  # fmt: skip
    T.append(Target("tiers.peer.socket", "restore from a peer's memory >= 0.7x a loopback socket copy of the same "
                    "bytes (floor time / restore time, same repetition)", _inv(per_rep("tiers.peer", "tiers.socket")),
                    0.7, ">="))  # fmt: skip
    for m in (1, 2, 3):
        at = f"at {m} rank{'s' if m > 1 else ''}"
        T.append(Target(f"tiers.memonly{m}", f"a memory-only step restored {at} <= 1.2x the hot-copy "
                        "restore (a committed step) of the same state (same repetition)",
                        per_rep(f"tiers.mem{m}.memonly", f"tiers.mem{m}.hot"), 1.2, "<="))  # fmt: skip
    res.targets = T
    return T
