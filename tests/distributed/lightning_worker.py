"""One Lightning job for tests/distributed/test_lightning_elastic.py, started as a user starts
one (``python lightning_worker.py JSON_ARGS``): ``Trainer(strategy="ddp", devices=N)`` on the CPU
(gloo), whose own launcher starts ranks 1..N-1 as copies of this command. ``CkptdCallback`` saves
every 2 steps, and the training data is its ``loader`` (with ``num_workers`` worker processes).
Each training step appends one line ``{"step", "epoch", "idx"}`` (the step its optimizer step
makes, the epoch, the batch's sample indices) to ``OUT/records.rank{r}.jsonl``. With
``stop_at``, the job stops after that step, as a preempted one would after its last commit. Rank r
writes ``OUT/result{r}.json`` at the end.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

from tests.hf_toy import IndexedData
from trainer_hooks.lightning import CkptdCallback

N, BATCH, SEED, EVERY = 96, 4, 5, 2


class Net(pl.LightningModule):
    def __init__(self, out: Path):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(4, 1)
        self.out = out

    def training_step(self, batch, batch_idx):
        with open(self.out / f"records.rank{self.global_rank}.jsonl", "a") as f:
            step = {"step": self.global_step + 1, "epoch": self.current_epoch, "idx": batch["idx"].tolist()}
            f.write(json.dumps(step) + "\n")
        return torch.nn.functional.mse_loss(self.fc(batch["x"]), batch["labels"])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.1)


class StopAt(pl.Callback):
    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            trainer.should_stop = True


def main() -> None:
    a = json.loads(sys.argv[1])
    out = Path(a["out"])
    cb = CkptdCallback(a["root"], every_n_steps=EVERY)
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=a["devices"],
        max_epochs=a["max_epochs"],
        callbacks=[cb] + ([StopAt(a["stop_at"])] if "stop_at" in a else []),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Net(out), cb.loader(IndexedData(N), BATCH, seed=SEED, num_workers=a.get("num_workers", 0)))
    result = {"restored": cb.restored_step, "global_step": trainer.global_step, "epoch": trainer.current_epoch}
    (out / f"result{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
