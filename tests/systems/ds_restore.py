"""Restore an imported DeepSpeed checkpoint at N ranks into FSDP2, for tests/systems/test_deepspeed.py.

    torchrun --nproc-per-node=3 tests/systems/ds_restore.py ROOT UNIVERSAL_DIR

The model of ``ds_train.py`` with each ``Linear`` sharded by FSDP2 over the ranks (at 3 ranks the
row blocks are uneven, as torch.chunk makes them: 6/6/4 and 2/2/0) and an AdamW restore the ckptd root with
``Checkpointer.restore``; every rank gathers the full weights and Adam moments and checks them bit
for bit against DeepSpeed's universal files (``zero/NAME/{fp32,exp_avg,exp_avg_sq}.pt``), then
prints ``RESTORED OK rank R of N``. No deepspeed import: the restoring job needs only ckptd.
"""

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def _param(path: Path) -> torch.Tensor:
    """A universal file's tensor: ``{"param": t}`` (ZeRO-1/2) or the bare flat tensor (ZeRO-3)."""
    obj = torch.load(path, weights_only=True)
    return obj["param"] if isinstance(obj, dict) else obj


def restore(root: str, universal: Path) -> None:
    from torch.distributed.fsdp import fully_shard

    from trainer_hooks import Checkpointer

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=0.5)
    with Checkpointer(root) as ck:
        ck.restore({"model": model, "optim": optim})
    assert optim.param_groups[0]["lr"] == 1e-2 and optim.param_groups[0]["weight_decay"] == 0.01
    for name, p in model.named_parameters():
        local = p.to_local()
        if dist.get_world_size() == 3 and name == "0.weight":  # really sharded, unevenly
            assert local.shape[0] == (6, 6, 4)[dist.get_rank()], (name, local.shape)
        full = p.full_tensor()
        assert torch.equal(full, _param(universal / "zero" / name / "fp32.pt").view_as(full)), name
        state = optim.state[p]
        for moment in ("exp_avg", "exp_avg_sq"):
            want = _param(universal / "zero" / name / f"{moment}.pt").view_as(full)
            assert torch.equal(state[moment].full_tensor(), want), (name, moment)
        assert float(state["step"]) == 4.0, name
    print(f"RESTORED OK rank {dist.get_rank()} of {dist.get_world_size()}", flush=True)


def main() -> None:
    dist.init_process_group("gloo")
    try:
        restore(sys.argv[1], Path(sys.argv[2]))
        # every rank is done before any tears its connections down (as tests/distributed/worker.py)
        dist.monitored_barrier(timeout=timedelta(seconds=120))
    finally:
        dist.destroy_process_group()
    # Skip interpreter teardown, where torch/gloo's native destructors have been seen to call
    # std::terminate after a clean run (tests/distributed/worker.py does the same).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
