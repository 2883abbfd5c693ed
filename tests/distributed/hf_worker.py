"""One rank of a Hugging Face job for tests/distributed/test_hf_elastic.py, started as torchrun
would start it (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment, gloo on the CPU):

    python hf_worker.py trainer|plain|accelerate JSON_ARGS

``trainer`` trains with ``trainer_hooks.hf.ElasticTrainer``; ``plain`` with a stock
``transformers.Trainer`` and ``CkptdCallback`` (which refuses a resume mid-epoch);
``accelerate`` runs a plain Accelerate loop with the documented swap to ckptd. The model records
the sample indices of every forward pass; after each optimizer step the rank appends one line
``{"step", "epoch", "idx"}`` to ``OUT/records.rank{r}.jsonl``. With ``kill_at``, every rank waits
for its saves to commit at that step and then SIGKILLs itself, as a preempted job dies. At the
end each rank writes ``OUT/result{r}.json`` (restored step, final step, optimizer step count).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

from tests.hf_toy import IndexedData, IndexedNet

N, BATCH, SEED = 34, 2, 5


class Recorder:
    def __init__(self, net: IndexedNet, out: Path, rank: int):
        self.net, self.rank = net, rank
        self.file = open(out / f"records.rank{rank}.jsonl", "a")  # noqa: SIM115 - open for the run

    def step(self, step: int, epoch: int | None) -> None:
        self.file.write(json.dumps({"step": step, "epoch": epoch, "idx": self.net.seen}) + "\n")
        self.file.flush()
        self.net.seen = []


def optimizer_steps(optim: torch.optim.Optimizer) -> list[int]:
    return sorted({int(s["step"]) for s in optim.state.values()})


def run_trainer(mode: str, a: dict, out: Path, rank: int) -> dict:
    import transformers

    from trainer_hooks.hf import CkptdCallback, ElasticTrainer

    net = IndexedNet()
    rec = Recorder(net, out, rank)
    holder: dict = {}

    class Record(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, train_dataloader=None, **kwargs):
            sampler = getattr(train_dataloader, "sampler", None)
            rec.step(state.global_step, getattr(sampler, "epoch", None))
            if state.global_step == a.get("kill_at"):
                holder["ckpt"].wait()
                os.kill(os.getpid(), signal.SIGKILL)

    args = transformers.TrainingArguments(
        output_dir=str(out / "hf"),
        max_steps=a["max_steps"],
        per_device_train_batch_size=BATCH,
        learning_rate=0.1,
        use_cpu=True,
        ddp_backend="gloo",
        ddp_find_unused_parameters=False,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=a.get("num_workers", 0),
        seed=SEED,
        train_sampling_strategy="random",
    )
    if mode == "trainer":
        trainer = ElasticTrainer(
            model=net,
            args=args,
            train_dataset=IndexedData(N),
            callbacks=[Record()],
            ckptd_root=a["root"],
            ckptd_every_n_steps=2,
        )
        cb = trainer.ckptd
    else:
        cb = CkptdCallback(a["root"], every_n_steps=2)
        trainer = transformers.Trainer(model=net, args=args, train_dataset=IndexedData(N), callbacks=[cb, Record()])

    class Ckpt:  # the Checkpointer opens during train(): look it up when needed
        def wait(self):
            cb.ckpt.wait()

    holder["ckpt"] = Ckpt()
    trainer.train()
    return {
        "restored": cb.restored_step,
        "global_step": trainer.state.global_step,
        "optimizer_steps": optimizer_steps(trainer.optimizer.optimizer),
        "sched_last_epoch": trainer.lr_scheduler.last_epoch,
    }


def run_accelerate(a: dict, out: Path, rank: int) -> dict:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from trainer_hooks import Checkpointer, ElasticSampler, StatefulLoader

    accelerator = Accelerator(cpu=True)
    net = IndexedNet()
    rec = Recorder(net, out, rank)
    model, optimizer = accelerator.prepare(net, torch.optim.AdamW(net.parameters(), lr=0.1))
    # the swap, 1: the loader is not prepared; ElasticSampler deals the epoch to the ranks
    loader = StatefulLoader(DataLoader(IndexedData(N), batch_size=BATCH, sampler=ElasticSampler(N, seed=SEED)))
    ckpt = Checkpointer(a["root"])
    state = {"model": model, "optim": optimizer, "sampler": loader.sampler}
    restored = ckpt.restore(state)  # 2: instead of accelerator.load_state + skip_first_batches
    step = restored or 0
    for epoch in range(loader.sampler.epoch, 2):
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            if step == a["max_steps"]:
                break
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            accelerator.backward(model(**batch)["loss"])
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            rec.step(step, epoch)
            if step % 2 == 0:
                ckpt.save(step, state)  # 3: instead of accelerator.save_state
            if step == a.get("kill_at"):
                ckpt.wait()
                os.kill(os.getpid(), signal.SIGKILL)
    if step % 2:
        ckpt.save(step, state)  # the last step
    ckpt.close()
    return {"restored": restored, "global_step": step, "optimizer_steps": optimizer_steps(optimizer.optimizer)}


def main() -> None:
    mode, a = sys.argv[1], json.loads(sys.argv[2])
    out = Path(a["out"])
    rank = int(os.environ["RANK"])
    result = run_accelerate(a, out, rank) if mode == "accelerate" else run_trainer(mode, a, out, rank)
    (out / f"result{rank}.json").write_text(json.dumps(result))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
