"""Erasure coding of the memory tier against replication (issue 37 item 4), on the real code of
``ckptd.server.erasure``, one process standing in for a group of k+m daemons (no network):

* encode: per member, the shares of its part (``contribution``) and folding as many shares into
  parity buffers (``fold``: a holder folds k*m shares of one block per step, m*|P| bytes);
* recover: rebuilding one lost member's part, and m lost members' parts, from the survivors'
  blocks (``recover``), checked bitwise;
* beside them a memcpy of the same bytes (what holding a pushed replica costs a receiver, and
  what reading a lost part back from a replica costs), and the bytes each node holds under
  ``--ec k+m`` and under ``--replicas R`` ((1+R)x its part).

Every member's part is the same random buffer (memory: one part, not n); the work per byte is
the same. Run: ``python -m benchmarks.erasure [--ec 4+2] [--sizes 64MiB 256MiB] [--replicas 2]``

``--daemons``: the wired tier side by side in one run, real daemons (``tests.server.ring3``: 3
daemons, a 3-rank gloo job, one rank per node, steps 1, 2 and 4 memory-only) once with
``--ec 2+1`` and once with ``--replicas 1`` (both survive one node loss): the bytes each daemon
holds of the newest memory-only step (own part, others' parts, parity), then daemon c SIGKILLed
and the restore at 2 ranks through a timed (the slowest rank's), checked bitwise, with the bytes
it read per tier. ``python -m benchmarks.erasure --daemons [--reps 3]``
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.common import fmt_bytes, parse_size
from ckptd.server.erasure import Stripes, contribution, fold, parse_ec, recover


def _best(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def run(k: int, m: int, size: int, replicas: int, repeat: int) -> None:
    n = k + m
    st = Stripes(tuple(f"node{i}" for i in range(n)), k, m, (size,) * n)
    part = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    parity = {(s, j): np.zeros(st.block, np.uint8) for s in range(n) for j in range(m)}

    def encode(i: int):
        for b in range(k):
            start, length = st.span(i, b)
            for _, s, j, share in contribution(st, i, b, part[start : start + length]):
                fold(parity[(s, j)], share)

    for p in parity.values():
        p[:] = 0
    t0 = time.perf_counter()
    for i in range(1, n):
        encode(i)
    rest = time.perf_counter() - t0
    t_enc, _ = _best(lambda: encode(0), 1)  # once: a second pass would fold the shares out again
    t_enc = min(t_enc, rest / (n - 1))

    def read(member, s, num):
        if num >= k:
            return parity[(s, num - k)]
        start, length = st.span(member, num)
        return part[start : start + length]

    t_one, got = _best(lambda: recover(st, [0], read), repeat)
    assert got[0] == part.tobytes(), "member 0 not rebuilt bitwise"
    lost = list(range(m))
    t_m, got = _best(lambda: recover(st, lost, read), repeat)
    assert all(got[i] == part.tobytes() for i in lost), "lost members not rebuilt bitwise"

    dst = np.empty_like(part)
    t_cp, _ = _best(lambda: np.copyto(dst, part), 5)
    sent = m * size  # bytes each node sends per step under either scheme with m = R
    gbs = lambda nbytes, t: nbytes / t / 1e9  # noqa: E731
    print(f"--ec {k}+{m}, part {fmt_bytes(size)} per node (block {fmt_bytes(st.block)}):")
    print(
        f"  encode  (contribution+fold) {t_enc:7.3f} s  {gbs(size, t_enc):6.2f} GB/s of part  "
        f"| memcpy of the {fmt_bytes(sent)} replication sends {m * t_cp:7.3f} s  "
        f"| ratio {t_enc / (m * t_cp):6.1f}x"
    )
    print(
        f"  recover 1 lost part         {t_one:7.3f} s  {gbs(size, t_one):6.2f} GB/s rebuilt  "
        f"| memcpy of the part from a replica {t_cp:7.3f} s  | ratio {t_one / t_cp:6.1f}x"
    )
    print(f"  recover {m} lost parts        {t_m:7.3f} s  {gbs(m * size, t_m):6.2f} GB/s rebuilt")
    held, rep = st.held(0), (1 + replicas) * size
    print(
        f"  held per node: ec {fmt_bytes(held)} ({held / size:.2f}x, survives {m} losses)  "
        f"| --replicas {replicas}: {fmt_bytes(rep)} ({1 + replicas}x, survives {replicas})  "
        f"| ec/replication {held / rep:.2f}"
        + (f"  | --replicas {m} (the same losses): {1 + m}x" if m != replicas else "")
    )


def run_daemons(reps: int) -> None:
    """``--daemons`` (module doc): one row per daemon and mode, one per restore."""
    import shutil
    import tempfile
    from pathlib import Path

    from tests.server.ring3 import LAST, held, restore, ring, save

    modes = {"--ec 2+1": {"CKPTD_EC": "2+1"}, "--replicas 1": {"CKPTD_REPLICAS": "1"}}
    ready = {
        "--ec 2+1": lambda root: lambda d: held(d, root, LAST)["parity_slots"] == 2,
        "--replicas 1": lambda root: lambda d: held(d, root, LAST)["others"] > 0,
    }
    work = Path(tempfile.mkdtemp(prefix="ckptd-bench-ec-"))
    try:
        for rep in range(reps):
            for mode, env in modes.items():
                d = work / f"{rep}-{mode.strip('-').replace(' ', '').replace('+', 'p')}"
                root, daemons = ring(d, **env)
                try:
                    out = save(d, root, daemons, ready[mode](root))
                    rows = {name: held(x, root, LAST) for name, x in zip("abc", daemons, strict=True)}
                    own = sum(r["own"] for r in rows.values())
                    total = sum(r["own"] + r["others"] + r["parity"] for r in rows.values())
                    for name, r in rows.items():
                        print(
                            f"{mode:13s} rep {rep} daemon {name}: own {fmt_bytes(r['own'])}, others' parts "
                            f"{fmt_bytes(r['others'])}, parity {fmt_bytes(r['parity'])}"
                        )
                    print(
                        f"{mode:13s} rep {rep} all: {fmt_bytes(total)} held for {fmt_bytes(own)} of parts "
                        f"({total / own:.2f}x)"
                    )
                    daemons[2].kill()
                    got = restore(out, daemons[0], root, "restore2")
                    assert {r["step"] for r in got} == {LAST}, got
                    tiers = {k: sum(r["tiers"].get(k, 0) for r in got) for k in ("local", "peer", "root")}
                    print(
                        f"{mode:13s} rep {rep} restore at 2 ranks after c's loss: "
                        f"{max(r['seconds'] for r in got):.2f} s, step {LAST} bitwise, bytes {tiers}"
                    )
                finally:
                    for x in daemons:
                        x.kill()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ec", default="4+2")
    ap.add_argument("--sizes", nargs="+", default=["64MiB", "256MiB"])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--daemons", action="store_true", help="the wired tier: real daemons, --ec 2+1 vs --replicas 1")
    ap.add_argument("--reps", type=int, default=1)
    args = ap.parse_args(argv)
    if args.daemons:
        run_daemons(args.reps)
        return
    k, m = parse_ec(args.ec)
    for size in args.sizes:
        run(k, m, parse_size(size), args.replicas, args.repeat)


if __name__ == "__main__":
    main()
