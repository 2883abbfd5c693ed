"""Profiles of the paths whose targets fail: py-spy (every thread, wall clock, idle included)
when it is installed, else pyinstrument (the calling thread only).

``profiled(prefix)`` wraps a block; it writes ``prefix.txt`` (a readable summary: wall-clock
samples per thread, then the functions with the most samples, inclusive and self) and, for
py-spy, ``prefix.collapsed.gz`` (the raw stacks, flamegraph.pl's input).
"""

from __future__ import annotations

import contextlib
import gzip
import os
import re
import shutil
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator

# Frames of these files are what the summary lists first: the code under study.
OWN = ("ckptd/", "trainer_hooks/", "storage_backends/")


def tool() -> str | None:
    if shutil.which("py-spy"):
        return "py-spy"
    try:
        import pyinstrument  # noqa: F401
    except ImportError:
        return None
    return "pyinstrument"


@contextlib.contextmanager
def profiled(prefix: str, title: str = "") -> Iterator[dict]:
    """Profile the block; yields a dict that gets ``tool``, ``summary`` (path) and ``top`` (the
    heaviest frames of our own code, for the report)."""
    info: dict = {"tool": tool(), "summary": prefix + ".txt", "top": []}
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    if info["tool"] == "py-spy":
        raw = prefix + ".collapsed"
        cmd = ["py-spy", "record", "--pid", str(os.getpid()), "--threads", "--idle", "--nonblocking"]
        cmd += ["--rate", "200", "--full-filenames", "--format", "raw", "--output", raw]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(0.5)  # let it attach
        t0 = time.perf_counter()
        try:
            yield info
        finally:
            wall = time.perf_counter() - t0
            proc.send_signal(signal.SIGINT)
            try:
                _, err = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            if os.path.exists(raw):
                with open(raw) as f:
                    collapsed = f.read()
                text, top = summarize(collapsed, title, wall)
                with gzip.open(raw + ".gz", "wt") as f:  # flamegraph.pl input, compressed
                    f.write(collapsed)
                os.unlink(raw)
            else:
                text, top = f"py-spy wrote nothing: {err[-2000:]}", []
            with open(info["summary"], "w") as f:
                f.write(text)
            info["top"] = top
    elif info["tool"] == "pyinstrument":
        from pyinstrument import Profiler

        p = Profiler(interval=0.002)
        p.start()
        try:
            yield info
        finally:
            p.stop()
            with open(info["summary"], "w") as f:
                f.write(f"# {title}\n# pyinstrument: the calling thread only\n\n")
                f.write(p.output_text(unicode=False, color=False, show_all=False))
    else:
        yield info


_SHORTEN = re.compile(
    r"\((?:[^()]*/)?((?:site-packages|ckptd|trainer_hooks|storage_backends|benchmarks|python3\.\d+)/[^()]*)\)"
)


def _frame_name(frame: str) -> str:
    """``func (/long/path/site-packages/torch/x.py:12)`` -> ``func (torch/x.py:12)``."""
    frame = frame.strip()
    m = _SHORTEN.search(frame)
    if not m:
        return frame
    short = m.group(1)
    for lead in ("site-packages/", "python3."):
        if short.startswith(lead):
            short = short.split("/", 1)[1]
    return frame[: m.start()] + f"({short})"


def summarize(collapsed: str, title: str = "", wall: float | None = None, n: int = 30) -> tuple[str, list[str]]:
    """A readable digest of py-spy's collapsed stacks (``frame;frame;... count`` per line)."""
    per_thread: Counter = Counter()
    inclusive: Counter = Counter()
    self_: Counter = Counter()
    own_inclusive: Counter = Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        c = int(count)
        if "profiled (" in stack and "profiling.py" in stack:
            continue  # py-spy attaching / detaching, outside the profiled block
        frames = [_frame_name(f) for f in stack.split(";") if f]
        thread = next((f for f in frames if f.startswith("thread ") or f.startswith('"')), frames[0])
        frames = [f for f in frames if not (f.startswith("thread ") or f.startswith("process "))]
        total += c
        per_thread[thread] += c
        for f in set(frames):
            inclusive[f] += c
            if any(o in f for o in OWN):
                own_inclusive[f] += c
        if frames:
            self_[frames[-1]] += c
    wall_samples = max(per_thread.values()) if per_thread else 1  # every thread is sampled each tick
    lines = [f"# {title}", f"# py-spy, all threads, idle included; {total} samples, {wall_samples} per thread"]
    lines.append("# percentages: samples / samples of one thread = share of the wall time spent there by one thread")
    if wall:
        lines.append(f"# wall time of the profiled block: {wall:.2f} s")
    lines.append("")
    lines.append("## samples per thread")
    for t, c in per_thread.most_common(20):
        lines.append(f"{c:8d}  {100 * c / wall_samples:5.1f}%  {t}")
    lines.append("")
    lines.append(f"## top {n} functions of ckptd / trainer_hooks / storage_backends, inclusive")
    top = []
    for f, c in own_inclusive.most_common(n):
        s = f"{c:8d}  {100 * c / wall_samples:5.1f}%  {f}"
        lines.append(s)
        top.append(s.strip())
    lines.append("")
    lines.append(f"## top {n} leaf frames (self time; idle waits included)")
    for f, c in self_.most_common(n):
        lines.append(f"{c:8d}  {100 * c / wall_samples:5.1f}%  {f}")
    lines.append("")
    lines.append(f"## top {n} functions, inclusive")
    for f, c in inclusive.most_common(n):
        lines.append(f"{c:8d}  {100 * c / wall_samples:5.1f}%  {f}")
    return "\n".join(lines) + "\n", top
