"""Train a tiny model with DeepSpeed ZeRO-1/2 on its CPU accelerator (gloo) and save a real
DeepSpeed checkpoint, for tests/systems/test_deepspeed.py.

    torchrun --nproc-per-node=2 tests/systems/ds_train.py OUT_DIR STAGE

Writes OUT_DIR/ck (``engine.save_checkpoint``, tag ``step3``, with the ``universal_checkpoint_info``
client state that ``ds_to_universal`` requires) and, from rank 0, OUT_DIR/module.pt: the module's
parameters after training (in fp32 training they are the master weights).
"""

import sys
from pathlib import Path

import deepspeed
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.local_launch import exit_after  # noqa: E402


def main() -> None:
    out, stage = Path(sys.argv[1]), int(sys.argv[2])
    # DeepSpeed's CPU accelerator JIT-compiles its shared-memory all-reduce (``deepspeed_shm_comm``,
    # ~9 minutes of C++ on 2 cores) when the first engine starts, unless the op is marked
    # incompatible, which is what DeepSpeed itself does where it cannot build it: then every
    # collective goes through torch.distributed (gloo here). ZeRO's partitioning, checkpoint
    # files and ``ds_to_universal`` are the same either way; only the all-reduce kernel differs.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optim, config=cfg)
    g = torch.Generator().manual_seed(1 + engine.global_rank)
    for _ in range(4):
        x, y = torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(str(out / "ck"), tag="step3", client_state={"universal_checkpoint_info": {}})
    # ZeRO-3 partitions the parameters themselves: gather them for the reference (a no-op below 3)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        if engine.global_rank == 0:
            torch.save({k: v.detach().clone() for k, v in engine.module.named_parameters()}, out / "module.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    exit_after(main)
