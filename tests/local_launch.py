"""Start N ranks on this machine as real processes, the way torchrun does (``env://``): each rank
gets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in its environment. For the
tests, the benchmarks and ``examples/elastic_demo.py``, which play the launcher from a checkout;
not shipped (training jobs use torchrun or their scheduler's launcher).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NoReturn

from tests.load import scaled

MASTER_ADDR = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind((MASTER_ADDR, 0))
        return s.getsockname()[1]


def rank_env(
    rank: int,
    world: int,
    port: int,
    *,
    pythonpath: str | Path | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """This process's environment plus what rank ``rank`` of ``world`` needs (one thread each);
    ``pythonpath`` goes in front of PYTHONPATH; ``extra_env`` comes last and wins."""
    env = {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": MASTER_ADDR,
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), os.environ.get("PYTHONPATH")]))
    env.update(extra_env or {})
    return env


def spawn_ranks(
    world: int,
    argv: Sequence[str],
    log_path: Callable[[int], Path],
    *,
    cwd: str | Path,
    pythonpath: str | Path | None = None,
    extra_env: Mapping[str, str] | Callable[[int], Mapping[str, str]] | None = None,
) -> list[subprocess.Popen]:
    """Start ``argv`` as ranks 0..world-1 with a fresh MASTER_PORT; rank r's stdout and stderr go
    to ``log_path(r)`` (its folder is created). ``extra_env``: for every rank, or rank -> its own."""
    port = free_port()
    procs = []
    for rank in range(world):
        log = Path(log_path(rank))
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as out:  # the child keeps its own descriptor
            procs.append(
                subprocess.Popen(
                    list(argv),
                    env=rank_env(
                        rank,
                        world,
                        port,
                        pythonpath=pythonpath,
                        extra_env=extra_env(rank) if callable(extra_env) else extra_env,
                    ),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=str(cwd),
                )
            )
    return procs


def wait_ranks(procs: Sequence[subprocess.Popen], timeout: float) -> list[int]:
    """Wait for every rank, ``timeout`` seconds in all (times ``tests.load.SCALE``: a bound for an
    idle machine), and return their exit codes. On timeout
    (or any other exception) the ranks still running are killed and the exception propagates
    (``subprocess.TimeoutExpired`` for the timeout)."""
    deadline = time.monotonic() + scaled(timeout)
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs]


def log_tails(log_path: Callable[[int], Path], world: int, tail: int = 4000) -> str:
    """The last ``tail`` characters of each rank's log (``log_path(r)``), for an error message."""
    parts = []
    for r in range(world):
        f = Path(log_path(r))
        if f.exists():
            parts.append(f"--- rank {r} ---\n" + f.read_text()[-tail:])
    return "\n".join(parts)


def wait_ok(procs: Sequence[subprocess.Popen], timeout: float, log_path: Callable[[int], Path], what: str) -> None:
    """``wait_ranks``; AssertionError with every rank's log tail on a timeout or a non-zero exit."""
    try:
        codes = wait_ranks(procs, timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{what}: timed out\n{log_tails(log_path, len(procs))}") from None
    if any(codes):
        raise AssertionError(f"{what}: exit codes {codes}\n{log_tails(log_path, len(procs))}")


def exit_after(main: Callable[..., int | None], *args) -> NoReturn:
    """Run one rank's ``main(*args)`` and leave with its exit code, skipping interpreter teardown.

    After a clean run (barrier, ``destroy_process_group``, results on disk) torch/gloo's native
    destructors have still aborted rank 0 at interpreter exit now and then ("terminate called
    without an active exception", SIGABRT): seen in the ZeRO and the elastic-demo ranks. What
    the rank had to do is done by then; ``os._exit`` after flushing leaves those destructors out.
    """
    code = 1
    try:
        code = main(*args) or 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
