"""One cold restore in a fresh process, as a job restarting after a preemption makes it.

``python -m benchmarks.fresh_restore SYSTEM PATH SIZE REF``: builds the benchmark state (other
values than the saved ones), restores it from ``PATH`` with ``SYSTEM`` (``ckptd``: the default
``Checkpointer.restore``; ``dcp``: ``dcp.load`` + ``set_state_dict``), and prints one JSON line:
the restore's wall time alone (``s``; not the import, the state's construction or the
``Checkpointer``'s), its page faults and CPU seconds, and whether the restored sentinel equals
the tensor saved in ``REF``. The in-process rows restore into a process that has saved and
freed gigabytes before; this one's memory history is a job's at start.
"""

from __future__ import annotations

import json
import resource
import sys
import time
import warnings

import torch

from benchmarks import state as st


def _usage() -> tuple[int, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_minflt + r.ru_majflt, r.ru_utime + r.ru_stime


def main(argv: list[str]) -> int:
    system, path, size, ref_path = argv[0], argv[1], int(argv[2]), argv[3]
    warnings.filterwarnings("ignore")
    model, optim, _ = st.build_local(size, seed=1)
    ref = torch.load(ref_path, weights_only=True)
    ck = None
    if system == "ckptd":
        from trainer_hooks import Checkpointer

        ck = Checkpointer(path)
    elif system != "dcp":
        raise SystemExit(f"unknown system {system!r}")
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
    print(json.dumps({"s": s, "ok": ok, "page_faults": u1[0] - u0[0], "cpu_s": round(u1[1] - u0[1], 4)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
