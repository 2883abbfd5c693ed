"""One cold restore in a fresh process, as a job restarting after a preemption makes it.

``python -m benchmarks.fresh_restore SYSTEM PATH SIZE REF``: builds the benchmark state (other
values than the saved ones) after importing the system's library (``ckptd``: ``trainer_hooks``;
``dcp``: ``torch.distributed.checkpoint`` and its ``state_dict`` helpers; right after torch, as
a job script's imports run), restores the state from ``PATH`` (``ckptd``: the default
``Checkpointer.restore``; ``dcp``: ``dcp.load`` + ``set_state_dict``), and prints one JSON line:
the import's wall time (``import_s``), the restore's alone (``s``; not the state's construction
or the ``Checkpointer``'s), its page faults and CPU seconds, and whether the restored sentinel
equals the tensor saved in ``REF``. The in-process rows restore into a process that has saved
and freed gigabytes before; this one's memory history is a job's at start.

``python -m benchmarks.fresh_restore --imports SYSTEM``: the files that system's import reads
after torch (one per line), so that the caller can evict them first: a cold import.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import resource
import sys
import time
import warnings

import torch

from benchmarks import state as st


def _usage() -> tuple[int, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_minflt + r.ru_majflt, r.ru_utime + r.ru_stime


def _import(system: str) -> float:
    """Imports what a job restoring with ``system`` imports (after torch); returns its wall time."""
    t0 = time.perf_counter()
    if system == "ckptd":
        import trainer_hooks  # noqa: F401
    elif system == "dcp":
        import torch.distributed.checkpoint  # noqa: F401
        import torch.distributed.checkpoint.state_dict  # noqa: F401
    else:
        raise SystemExit(f"unknown system {system!r}")
    return time.perf_counter() - t0


def imported_files(system: str) -> list[str]:
    """The source, bytecode and shared-object files ``_import(system)`` loads after torch."""
    before = set(sys.modules)
    _import(system)
    out = []
    for name in set(sys.modules) - before:
        f = getattr(sys.modules[name], "__file__", None) or ""
        if f:
            out.append(f)
            if f.endswith(".py"):
                with contextlib.suppress(NotImplementedError, ValueError):
                    out.append(importlib.util.cache_from_source(f))
    return sorted(f for f in out if os.path.isfile(f))


def main(argv: list[str]) -> int:
    if argv[:1] == ["--imports"]:
        print("\n".join(imported_files(argv[1])))
        return 0
    system, path, size, ref_path = argv[0], argv[1], int(argv[2]), argv[3]
    warnings.filterwarnings("ignore")
    import_s = _import(system)  # right after torch, as a job script's imports run
    model, optim, _ = st.build_local(size, seed=1)
    ref = torch.load(ref_path, weights_only=True)
    ck = None
    if system == "ckptd":
        from trainer_hooks import Checkpointer

        ck = Checkpointer(path)
    u0 = _usage()
    t0 = time.perf_counter()
    if ck is not None:
        ck.restore({"model": model, "optim": optim})
    else:
        import torch.distributed.checkpoint as dcp

        sd = st.dcp_state(model, optim)
        dcp.load(sd, storage_reader=dcp.FileSystemReader(path))
        st.dcp_apply(model, optim, sd)
    s = time.perf_counter() - t0
    u1 = _usage()
    if ck is not None:
        ck.close()
    ok = torch.equal(st.sentinel(model).detach(), ref)
    print(
        json.dumps(
            {"s": s, "import_s": import_s, "ok": ok, "page_faults": u1[0] - u0[0], "cpu_s": round(u1[1] - u0[1], 4)}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
