"""The printed table, the markdown report and the PNG chart of one run.

A hand-written analysis can live in the report between the ``ANALYSIS_BEGIN``/``ANALYSIS_END``
markers: regenerating the report keeps it (it says which run it was written for).
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

from benchmarks.common import fmt_bytes
from benchmarks.results import OK, Results, Row

ANALYSIS_BEGIN = "<!-- ANALYSIS_BEGIN (kept when the report is regenerated) -->"
ANALYSIS_END = "<!-- ANALYSIS_END -->"
SECTION_TITLES = {
    "planning": "Planning micro-benchmark (pure code, no I/O)",
    "local": "Single process, local disk",
    "incremental": "Incremental saves",
    "reshard": "Resharding: saved at 4 ranks, restored at 3 and 2 (gloo, real processes)",
    "s3": "S3 on the loopback moto server",
    "rgw": "S3 on a loopback Ceph RADOS Gateway (one-node cluster, memstore OSD)",
    "memory": "Host memory across consecutive async saves",
    "gpu": "GPU",
}


def _v(r: Row, x: float | None) -> str:
    if x is None:
        return "-"
    if r.unit == "x":
        return f"{x:.3f}x"
    if r.unit == "B":
        return fmt_bytes(x)
    return f"{x:.3f} s" if x < 100 else f"{x:.0f} s"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def table(res: Results) -> str:
    lines = []
    w = max([len(r.id) for r in res.rows.values()] + [10])
    head = f"{'row':<{w}}  {'median':>10}  {'min':>10}  {'x floor':>8}  {'x DCP':>7}  note"
    for sec in _sections(res):
        lines += ["", f"[{sec}] {SECTION_TITLES.get(sec, sec)}", head, "-" * len(head)]
        for r in res.rows.values():
            if r.section != sec:
                continue
            note = r.note if r.status != OK else ""
            lines.append(
                f"{r.id:<{w}}  {_v(r, r.median):>10}  {_v(r, r.min):>10}  {_x(r.ratio_floor):>8}  "
                f"{_x(r.ratio_dcp):>7}  {(r.status + ': ' + note) if note else ''}"[:240]
            )
    if res.targets:
        lines += ["", "targets:"]
        for t in res.targets:
            val = "-" if t.value is None else f"{t.value:.3f}"
            lines.append(f"  {t.verdict:<4}  {val:>8} {t.op} {t.limit:<5}  {t.text}")
    return "\n".join(lines)


def _sections(res: Results) -> list[str]:
    seen = []
    for r in res.rows.values():
        if r.section not in seen:
            seen.append(r.section)
    return seen


# ------------------------------------------------------------------------------------ chart


def chart(res: Results, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(15, 10))
    _bars(axes[0][0], res, lambda r: r.section == "local", "single process: time / floor (median of per-rep ratios)")
    _bars(axes[0][1], res, lambda r: r.section in ("reshard", "s3", "rgw", "incremental") and r.unit == "s",
          "resharding, S3, incremental: time / floor")  # fmt: skip
    _memory(axes[1][0], res)
    _bars(axes[1][1], res, lambda r: r.id.startswith("reshard.") and ".bytes." in r.id,
          "bytes read / bytes restored (rchar)", use_median=True)  # fmt: skip
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _bars(ax, res: Results, pick, title: str, use_median: bool = False) -> None:
    rows = [r for r in res.rows.values() if pick(r) and (r.median if use_median else r.ratio_floor) is not None]
    if not rows:
        ax.set_title(title + " (not run)")
        ax.axis("off")
        return
    vals = [r.median if use_median else r.ratio_floor for r in rows]
    colors = ["tab:green" if r.id.startswith(("ckptd", "s3.ckptd", "incremental")) or ".ckptd" in r.id else
              "tab:blue" if "dcp" in r.id else "tab:gray" for r in rows]  # fmt: skip
    y = range(len(rows))
    ax.barh(list(y), vals, color=colors)
    ax.set_yticks(list(y))
    ax.set_yticklabels([r.id for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="k", lw=0.8, ls="--")
    for i, v in enumerate(vals):
        ax.text(v, i, f" {v:.2f}", va="center", fontsize=7)
    ax.set_title(title, fontsize=9)


def _memory(ax, res: Results) -> None:
    curves = res.sections.get("memory", {}).get("curves", {})
    if not curves:
        ax.set_title("memory (not run)")
        ax.axis("off")
        return
    for name, c in curves.items():
        s, base = c["state_bytes"], c["baseline_rss"]
        xs = range(1, len(c["peaks"]) + 1)
        ax.plot(xs, [(p - base) / s for p in c["peaks"]], label=f"{name}: peak during save", lw=1.2)
        ax.plot(xs, [(p - base) / s for p in c["after_commit"]], label=f"{name}: after commit", lw=0.8, ls="--")
    ax.axhline(1.0, color="k", lw=0.8, ls=":")
    ax.set_xlabel("consecutive save")
    ax.set_ylabel("RSS above model+optimizer / state bytes")
    st = next(iter(curves.values()))["state_bytes"]
    ax.set_title(f"host RSS across {len(next(iter(curves.values()))['peaks'])} saves (state {fmt_bytes(st)})",
                 fontsize=9)  # fmt: skip
    ax.legend(fontsize=7)


# --------------------------------------------------------------------------------- markdown


def _old_analysis(path: str) -> str | None:
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    if ANALYSIS_BEGIN in text and ANALYSIS_END in text:
        return text[text.index(ANALYSIS_BEGIN) : text.index(ANALYSIS_END) + len(ANALYSIS_END)]
    return None


def write_markdown(res: Results, path: str, chart_path: str | None) -> None:
    m = res.meta
    mi = m.get("machine", {})
    disk = mi.get("disk", {})
    out = ["# ckptd benchmark results", ""]
    out += [
        f"Generated by `{m.get('command')}` on {mi.get('date')} in {m.get('wall_s', 0):.0f} s of wall time. "
        f"State: {m.get('size_text')} (fp32 parameters + AdamW exp_avg/exp_avg_sq), {m.get('reps')} repetitions.",
        "",
        "Run it: `python -m benchmarks.run --size 1.5GiB --out results.json` (full; about 10 minutes here), "
        "`python -m benchmarks.run --quick` (64 MiB smoke run), `--only local,reshard,...` for some sections. "
        "`pip install py-spy` to get all-thread profiles (else pyinstrument, main thread only).",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        f"| CPU | {mi.get('cpu_model')}, {mi.get('cores')} cores ({mi.get('cores_usable')} usable) |",
        f"| RAM | {fmt_bytes(mi.get('ram', 0))} |",
        f"| disk | {disk.get('device')} ({disk.get('fstype')}, {fmt_bytes(disk.get('size', 0))}, "
        f"rotational: {disk.get('rotational')}) mounted on {disk.get('mount')} |",
        f"| software | Python {mi.get('python')}, torch {mi.get('torch')}, numpy {mi.get('numpy')}, "
        f"tensorstore {mi.get('tensorstore')}, kernel {mi.get('kernel')} |",
        f"| load average at start | {', '.join(f'{x:.2f}' for x in mi.get('loadavg_at_start', []))} "
        "(the machine is shared with other developers) |",
        f"| date | {mi.get('date')} |",
        f"| code measured | ckptd at {mi.get('code_revision')} |",
        "",
        "## Method",
        "",
        "- Every system gets the same synthetic state (sizes below). Inside each repetition the systems run "
        "interleaved (A, B, C, D, then D, C, B, A, then B, C, D, A ...: each system follows different "
        "neighbours), and each figure's ratio to its floor and to DCP is taken "
        "*within* the repetition; the tables give the median of those per-repetition ratios, and the median "
        "and min of the times. The disk swings 2-3x between runs; ratios of neighbours cancel most of it.",
        "- Cold reads: before every read, the files it will read are evicted from the page cache "
        f"({m.get('cache_drop')}). "
        "Code pages stay cached (`echo 3` would also evict torch's shared libraries and charge every system "
        "for re-reading them). Writes start with whatever the cache holds; each write ends with fsync.",
        "- Single-process rows: before every system the harness runs `sync` (so the previous system's dirty pages "
        "and its deleted files' discards are not flushed during the next one) and waits until the machine has "
        "been under 10% busy for 0.2 s (`settle_s` in the JSON). Around every timed block it records the "
        "process's CPU seconds, page faults and busiest threads, and the CPU that ran *outside* the process "
        "(`outside_cpu_s`, of which `kswapd_s` is page reclaim), and the machine's /proc/vmstat stall counters "
        "(`vm_stalls`: pages scanned by direct reclaim, allocation and compaction stalls: memory pressure).",
        "- `block` = time until the snapshot is safe to mutate (ckptd: `save` returns; DCP: `async_save` returns, "
        "or `staging_completion` for asynchronous staging); `commit` = until durable/committed.",
        "- Systems that keep buffers across calls (ckptd, DCP with an explicit `DefaultStager`) get one untimed "
        "warm-up call first (their first-call times are in the JSON, `extra.first_call_s`).",
        "- Bytes read per rank (resharding): the delta of `/proc/self/io` `rchar` (bytes read()/pread() returned "
        "to the rank) for every system alike, over the bytes the rank restores; the raw floor's ratio checks the "
        "method. `read_bytes` (block layer) is in the JSON too, but the ranks share one page cache here, so it "
        "counts bytes that two ranks both read once.",
        f"- S3 rows use {fmt_bytes(m.get('s3_size', 0))} of state, memory rows {fmt_bytes(m.get('mem_size', 0))} "
        f"over {m.get('mem_saves')} saves (written to `/dev/shm`: the RSS does not depend on the medium, "
        "and 2 x 50 saves on this disk take minutes), incremental rows min(size, 512 MiB). moto is a correctness "
        "server on the same 2 cores as the client; its figures measure moto, not S3.",
        "- Pinned memory needs CUDA: on this CPU-only machine `StagingOptions(use_pinned_memory=True)` is "
        "ignored by torch and `FileSystemWriter(cache_staged_state_dict=True)` fails (it pins), so the DCP "
        "options measured are: default, DefaultStager with cached buffers (sync), with shared-memory cached "
        "buffers (sync), and with asynchronous staging (cached).",
        "",
    ]
    out += ["## Targets", "", "| target | measured | limit | verdict | notes |", "|---|---|---|---|---|"]
    for t in res.targets:
        val = "-" if t.value is None else f"{t.value:.3f}"
        note = t.detail
        if t.profile and (t.passed is False or t.id.startswith(("s3.", "rgw."))):
            note = (note + "; " if note else "") + f"profile: `{os.path.relpath(t.profile, Path(path).parent)}`"
        out.append(f"| {t.text} | {val} | {t.op} {t.limit} | **{t.verdict}** | {note} |")
    out.append("")
    if chart_path:
        out += [f"![chart]({os.path.relpath(chart_path, Path(path).parent)})", ""]
    for sec in _sections(res):
        out += [f"## {SECTION_TITLES.get(sec, sec)}", ""]
        info = res.sections.get(sec, {})
        if info.get("model"):
            out += [f"State: {fmt_bytes(info.get('state_bytes', 0))}, {info['model']}.", ""]
        out += ["| row | what | median | min | x floor | x DCP | n | status |", "|---|---|---|---|---|---|---|---|"]
        for r in res.rows.values():
            if r.section != sec:
                continue
            status = r.status if r.status == OK else f"**{r.status}**: {r.note}"
            out.append(
                f"| `{r.id}` | {r.label} | {_v(r, r.median)} | {_v(r, r.min)} | {_x(r.ratio_floor)} | "
                f"{_x(r.ratio_dcp)} | {len(r.values)} | {status.replace(chr(10), ' ')[:400]} |"
            )
        out.append("")
        out += _section_extras(res, sec)
    out += _profiles(res, path)
    if res.notes:
        out += ["## Notes from the run", ""] + [f"- {n}" for n in res.notes] + [""]
    fails = res.sections.get("local", {}).get("failures")
    if fails:
        out += ["## Correctness failures", ""] + [f"- {f}" for f in fails] + [""]
    old = _old_analysis(path)
    out += [old if old else f"{ANALYSIS_BEGIN}\n{ANALYSIS_END}", ""]
    Path(path).write_text("\n".join(out))


def _section_extras(res: Results, sec: str) -> list[str]:
    out: list[str] = []
    info = res.sections.get(sec, {})
    if sec == "planning" and info.get("grid"):
        out += [
            f"Scaling (plan_reads for one rank restoring at 3/4 of the saving ranks; plan_writes once per "
            f"distinct signature). plan_reads grows {info.get('reads_growth_over_ranks', 0):.2f}x and plan_writes "
            f"{info.get('writes_growth_over_ranks', 0):.1f}x over {info.get('ranks_growth', 0):.0f}x more ranks.",
            "",
            "| saving ranks | tensors | plan_reads (s) | chunks touched | plan_writes per signature (s) |",
            "|---|---|---|---|---|",
        ]
        for g in info["grid"]:
            out.append(
                f"| {g['ranks']} | {g['tensors']} | {g['plan_reads_s']:.3f} | {g['chunks']} | "
                f"{g['plan_writes_per_sig_s']:.3f} |"
            )
        out.append("")
    if sec == "local":
        blk = res.rows.get("ckptd.block")
        if blk and blk.extra.get("first_call_s") is not None:
            out += [
                f"ckptd's first save (allocates its snapshot buffers: page faults) blocked "
                f"{blk.extra['first_call_s']:.2f} s and committed in {blk.extra.get('first_commit_s', 0):.2f} s; "
                f"staged bytes {fmt_bytes(blk.extra.get('staged_bytes', 0))}.",
                "",
            ]
    if sec == "local":
        cpu = {
            rid: statistics.median(res.rows[rid].extra["cpu_s"])
            for rid in ("ckptd.commit", "dcp.save", "dcp.async.default.commit", "dcp.async.sync_cached.commit")
            if rid in res.rows and res.rows[rid].extra.get("cpu_s")
        }
        if cpu:
            out += [
                "CPU seconds of the saving process from the call until durable (median; every thread; "
                "what a save takes from training besides its wall time): "
                + ", ".join(f"`{rid}` {v:.2f} s" for rid, v in cpu.items())
                + ".",
                "",
            ]
    if sec == "reshard" and info.get("checks"):
        out += [f"Restored-value checksums (sum of the embedding over ranks): {info['checks']}", ""]
    if sec == "incremental" and info.get("trainable_fraction") is not None:
        out += [f"Trainable (changing) fraction of the state's bytes: {info['trainable_fraction']:.1%}.", ""]
    if sec == "memory" and info.get("curves"):
        out += ["| system | baseline RSS | of which library set-up | state | staged buffers / state "
                "| peak above baseline / state (max) | peak above baseline - state | growth save 2 -> last |",
                "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for name, c in info["curves"].items():
            s, base = c["state_bytes"], c["baseline_rss"]
            top = max(c["peaks"]) - base
            growth = (c["after_commit"][-1] - c["after_commit"][1]) / s if len(c["after_commit"]) > 1 else 0
            setup = fmt_bytes(c["setup_rss"]) if c.get("setup_rss") is not None else "-"
            staged = f"{c['staged_bytes'] / s:.3f}x" if c.get("staged_bytes") else "-"
            out.append(
                f"| {name} | {fmt_bytes(base)} | {setup} | {fmt_bytes(s)} | {staged} | {top / s:.3f}x "
                f"| {fmt_bytes(top - s)} | {growth:+.3f}x |"
            )
        out += ["", "The baseline is taken after the library is imported and its saver constructed; the "
                "set-up column is what that cost on top of the model and optimizer.", ""]  # fmt: skip
    if info.get("traceback"):
        out += ["```", info["traceback"][-1500:], "```", ""]
    return out


def _profiles(res: Results, path: str) -> list[str]:
    out: list[str] = []
    profs = []
    for sec in ("local", "reshard", "s3", "rgw"):
        for name, p in (res.sections.get(sec, {}).get("profiles") or {}).items():
            if p:
                profs.append((f"{sec}/{name}", p))
    pl = res.sections.get("planning", {}).get("profile")
    if pl:
        profs.append(("planning/plan_writes", pl))
    if not profs:
        return out
    out += ["## Profiles", "", "Summaries under `benchmarks/profiles/` (py-spy: every thread, idle included; a "
            "percentage is samples / one thread's samples, so 200% means two threads' worth of the block's wall time "
            "spent there). Heaviest frames of ckptd's own code:", ""]  # fmt: skip
    base = Path(path).parent
    for name, p in profs:
        summ = p.get("summary")
        rel = os.path.relpath(summ, base) if summ else "-"
        out.append(f"- **{name}** ({p.get('tool')}): `{rel}`")
        for line in (p.get("top") or [])[:6]:
            out.append(f"    - `{line}`")
    out.append("")
    return out
