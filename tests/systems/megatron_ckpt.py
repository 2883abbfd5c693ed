"""Megatron-Core's own ``torch_dist`` checkpoint, for tests/systems/test_megatron.py.

    torchrun --nproc-per-node=2 tests/systems/megatron_ckpt.py save OUT
    torchrun --nproc-per-node=3 tests/systems/megatron_ckpt.py restore ROOT OUT.ref.pt

``save``: each rank holds a row block of a Linear layer's weight and bias as Megatron
``ShardedTensor``s and saves them with ``megatron.core.dist_checkpointing.save`` (its default
``torch_dist`` backend: DCP files plus Megatron's ``common.pt`` and ``metadata.json``); rank 0
also writes the full tensors to OUT.ref.pt. megatron-core 0.16.1 makes two CUDA calls on this
path even when every tensor is on the CPU (``torch.cuda.synchronize()`` after its
device-to-host copies, and an all-reduce of write failures placed on
``torch.cuda.current_device()``); on a machine without CUDA they are replaced by their CPU
equivalents below (a no-op, and the CPU device), and nothing of Megatron's own code is changed.

``restore``: a ``Linear(6, 8)`` sharded by FSDP2 over the ranks (3 ranks: uneven row blocks of
3, 3 and 2) restores the imported ckptd root with ``Checkpointer.restore``; every rank checks
its full tensors against OUT.ref.pt bit for bit and prints ``RESTORED OK``.
"""

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

ROWS, COLS = 8, 6


def save(out: str) -> None:
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.current_device = lambda: "cpu"
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    weight, bias = torch.randn(ROWS, COLS), torch.randn(ROWS)
    rows = ROWS // world
    part = slice(rank * rows, (rank + 1) * rows)
    sharded = {
        "layer.weight": ShardedTensor.from_rank_offsets("layer.weight", weight[part].clone(), (0, rank, world)),
        "layer.bias": ShardedTensor.from_rank_offsets("layer.bias", bias[part].clone(), (0, rank, world)),
    }
    os.makedirs(out, exist_ok=True)
    dist_checkpointing.save(sharded, out)
    if rank == 0:
        torch.save({"weight": weight, "bias": bias}, out + ".ref.pt")


def restore(root: str, ref_path: str) -> None:
    from torch.distributed.fsdp import fully_shard

    from trainer_hooks import Checkpointer

    ref = torch.load(ref_path)
    model = torch.nn.Module()
    model.layer = torch.nn.Linear(COLS, ROWS)
    fully_shard(model.layer)
    with Checkpointer(root) as ck:
        ck.restore({"layer": model.layer})
    for name, value in ref.items():
        got = getattr(model.layer, name).full_tensor()
        assert torch.equal(got, value), name
    print(f"RESTORED OK rank {dist.get_rank()} of {dist.get_world_size()}", flush=True)


def main() -> None:
    dist.init_process_group("gloo")
    try:
        if sys.argv[1] == "save":
            save(sys.argv[2])
        else:
            restore(sys.argv[2], sys.argv[3])
        # every rank is done before any tears its connections down (as tests/distributed/worker.py)
        dist.monitored_barrier(timeout=timedelta(seconds=120))
    finally:
        dist.destroy_process_group()
    if sys.argv[1] == "restore":
        # Skip interpreter teardown, where torch/gloo's native destructors have been seen to call
        # std::terminate after a clean run (tests/distributed/worker.py does the same). Not after
        # a save: Megatron's multiprocessing manager must be shut down by the normal exit.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":  # Megatron's writer starts processes with spawn
    main()
