"""Helpers shared by every benchmark row: sizes, timing statistics, page-cache control, process
counters (RSS, /proc/self/io) and the description of the machine the numbers come from."""

from __future__ import annotations

import contextlib
import datetime as _dt
import gc
import os
import platform
import re
import shutil
import statistics
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
_UNITS = {"": 1, "b": 1, "k": KiB, "kb": KiB, "kib": KiB, "m": MiB, "mb": MiB, "mib": MiB, "g": GiB, "gb": GiB}
_UNITS["gib"] = GiB


def parse_size(text: str | int) -> int:
    """``"1.5GiB"``, ``"64MiB"``, ``"512M"`` or a plain byte count (binary units throughout)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 64MiB, 1.5GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_bytes(n: float) -> str:
    for unit, f in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= f:
            return f"{n / f:.2f} {unit}"
    return f"{int(n)} B"


def median(xs: Iterable[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def minimum(xs: Iterable[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return min(xs) if xs else None


def now_utc() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def collect() -> None:
    """Free what the previous system left behind before timing the next one."""
    gc.collect()


def _cpu_line() -> list[int]:
    """The machine-wide ``cpu`` line of ``/proc/stat`` (user, nice, system, idle, iowait, irq,
    softirq, steal, ...), in clock ticks; zeros if unreadable."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        return v if len(v) == 8 else [0] * 8
    except (OSError, ValueError):
        return [0] * 8


def busy_ticks() -> int:
    """Machine-wide non-idle CPU time (user, nice, system, irq, softirq), ticks."""
    v = _cpu_line()
    return v[0] + v[1] + v[2] + v[5] + v[6]


def steal_ticks() -> int:
    """Machine-wide CPU time stolen by the hypervisor, ticks."""
    return _cpu_line()[7]


def stat_ticks(path: str) -> tuple[str, int] | None:
    """``(comm, utime + stime)`` of a ``/proc/.../stat`` file (a process or a thread), ticks;
    None if unreadable (the task is gone)."""
    with contextlib.suppress(OSError, ValueError, IndexError), open(path) as f:
        head, _, rest = f.read().rpartition(")")
        fields = rest.split()
        return head.split("(", 1)[1], int(fields[11]) + int(fields[12])
    return None


def proc_ticks() -> dict[int, tuple[str, int]]:
    """``stat_ticks`` of every other process on the machine (all its threads), kernel threads
    included, by pid. About 1 ms for ~60 processes."""
    me = os.getpid()
    out = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != me:
            got = stat_ticks(f"/proc/{pid}/stat")
            if got is not None:
                out[int(pid)] = got
    return out


# Counters of /proc/vmstat that say the kernel made an allocating thread wait: reclaiming page
# cache itself (direct reclaim), or compacting memory for a large page-cache folio.
VMSTAT_STALLS = ("pgscan_direct", "allocstall_normal", "allocstall_movable", "compact_stall")


def vmstat_stalls() -> dict[str, int]:
    """The ``VMSTAT_STALLS`` counters (machine-wide); empty where /proc/vmstat is unreadable."""
    out = {}
    with contextlib.suppress(OSError), open("/proc/vmstat") as f:
        for line in f:
            name, _, value = line.partition(" ")
            if name in VMSTAT_STALLS:
                out[name] = int(value)
    return out


def settle(max_wait: float = 5.0, window: float = 0.2, busy: float = 0.1) -> float:
    """Flush the filesystems (``sync``: dirty pages, and the journal commit that issues the
    discards of deleted files on a ``discard`` mount), then wait until the machine has been quiet
    for ``window`` seconds (under ``busy`` of its CPUs busy, this process included), at most
    ``max_wait``; return the seconds waited.

    What one system leaves behind (a deleted 1.5 GiB folder's discards, writeback, a background
    thread finishing) must not run on the two cores while the next system is timed: the timed
    systems follow one another in a fixed cycle, so that work would always land on the same
    neighbour. Applied before every system alike."""
    hz, ncpu = os.sysconf("SC_CLK_TCK"), os.cpu_count() or 1
    t0 = time.monotonic()
    os.sync()
    while True:
        b0 = busy_ticks()
        time.sleep(window)
        if (busy_ticks() - b0) / hz < busy * window * ncpu or time.monotonic() - t0 >= max_wait:
            return time.monotonic() - t0


def dcp_staged(response):
    """Wait until a ``dcp.async_save`` snapshot is safe to mutate; return the upload's future.
    With asynchronous staging that is ``staging_completion``; otherwise the call's return."""
    if hasattr(response, "staging_completion"):
        response.staging_completion.result()
        return response.upload_completion
    return response


def rotate(items: list, k: int) -> list:
    """The interleaving order of repetition ``k``: A,B,C,D then D,C,B,A then B,C,D,A then
    C,B,A,D ...: the order shifts by one every two repetitions and runs backwards in odd ones,
    so each system is timed after different neighbours. In a plain rotation (A,B,C then B,C,A)
    C always follows B, and whatever B leaves behind (gigabytes freed, files deleted, the VM
    handing memory back to its host) always lands on C."""
    if not items:
        return items
    seq = items if k % 2 == 0 else items[::-1]
    j = (k // 2) % len(seq)
    return seq[j:] + seq[:j]


# ------------------------------------------------------------------------------ page cache


@dataclass
class CacheDropper:
    """Makes the next read of ``paths`` cold: ``sync``, ``posix_fadvise(DONTNEED)`` on every file
    under them (their clean pages leave the page cache), then ``echo 2 > drop_caches`` (dentries
    and inodes, as root) so that opening the files is cold too. Code pages of the running
    programs stay cached, as they would on a node that restarts a job: ``echo 3`` would evict
    them as well and charge every system for re-reading torch's shared libraries."""

    method: str | None = None
    calls: int = 0
    errors: list[str] = field(default_factory=list)

    def __call__(self, *paths: str) -> str:
        self.calls += 1
        os.sync()
        for p in paths:
            for f in _files(p):
                with contextlib.suppress(OSError):
                    fd = os.open(f, os.O_RDONLY)
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)
        method = "posix_fadvise(DONTNEED) on the files read"
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("2\n")
            method += " + echo 2 > /proc/sys/vm/drop_caches (dentries, inodes)"
        except OSError as e:
            if len(self.errors) < 3:
                self.errors.append(f"drop_caches: {e}")
        self.method = method
        return method


def _files(path: str) -> Iterable[str]:
    if os.path.isfile(path):
        yield path
        return
    for d, _, names in os.walk(path):
        for n in names:
            yield os.path.join(d, n)


drop_cache = CacheDropper()


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


# -------------------------------------------------------------------------- process counters


def proc_io() -> dict[str, int]:
    """This process's /proc/self/io (all threads): ``read_bytes`` is what the block layer read
    for it (page-cache misses), ``rchar`` what read()/pread() returned."""
    out = {}
    try:
        with open("/proc/self/io") as f:
            for line in f:
                k, v = line.split(":")
                out[k.strip()] = int(v)
    except OSError:
        pass
    return out


_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * KiB
    return 0


class Timer:
    def __enter__(self) -> Timer:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.s = time.perf_counter() - self.t0


# ------------------------------------------------------------------------------- machine info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * KiB
    except OSError:
        pass
    return 0


def _disk(path: str) -> dict[str, Any]:
    path = os.path.realpath(path)
    best, dev, fstype = "", "?", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                d, mnt, typ = line.split()[:3]
                if path.startswith(mnt) and len(mnt) > len(best):
                    best, dev, fstype = mnt, d, typ
    except OSError:
        pass
    usage = shutil.disk_usage(path)
    name = os.path.basename(dev)
    rot = None
    with contextlib.suppress(OSError), open(f"/sys/block/{name}/queue/rotational") as f:
        rot = f.read().strip() == "1"
    return {
        "path": path,
        "device": dev,
        "mount": best,
        "fstype": fstype,
        "size": usage.total,
        "free": usage.free,
        "rotational": rot,
    }


def machine_info(bench_dir: str) -> dict[str, Any]:
    from importlib import metadata

    import numpy
    import torch

    try:
        ts_version = metadata.version("tensorstore")
    except metadata.PackageNotFoundError:
        ts_version = None
    try:
        py_spy = subprocess.run(["py-spy", "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        py_spy = None
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        rev = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "ckptd", "trainer_hooks",
                                "storage_backends"], capture_output=True, text=True)  # fmt: skip
        code = rev.stdout.strip() + (" + uncommitted changes" if dirty.stdout.strip() else "")
    except OSError:
        code = None
    return {
        "code_revision": code,
        "date": now_utc(),
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "ram": _mem_total(),
        "disk": _disk(bench_dir),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "tensorstore": ts_version,
        "cuda": torch.cuda.is_available(),
        "loadavg_at_start": os.getloadavg(),
        "py_spy": py_spy,
    }
