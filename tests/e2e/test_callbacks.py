"""The Lightning and Hugging Face Trainer callbacks, on the CPU with a model defined here (no
downloads): a run saves through ckptd every 2 steps and is stopped after step 2 (as a preempted
job would be); a new run with the callback restores step 2 and finishes, and its weights are
bitwise those of a run that was never stopped. Saves fall on epoch boundaries with sequential
data, so the data the resumed run sees is the data the uninterrupted run saw.
"""

from __future__ import annotations

import pytest
import torch

from ckptd import catalog
from storage_backends import open_store
from tests.hf_toy import IndexedData, IndexedNet

pytestmark = pytest.mark.timeout(300)

N, BATCH = 8, 4  # two steps per epoch


def committed(root: str) -> list[int]:
    with open_store(root) as store:
        return catalog.committed_steps(store)


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g)


# ------------------------------------------------------------------------------------ Lightning


@pytest.mark.filterwarnings(
    # lightning 2.6 on torch 2.13 calls a deprecated torch pytree API; not about this code
    r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning"
)
def test_lightning_saves_and_resumes(tmp_path):
    pl = pytest.importorskip(
        "lightning.pytorch", reason="the lightning extra is not installed (pip install -e .[lightning])"
    )
    from torch.utils.data import DataLoader, TensorDataset

    from trainer_hooks.lightning import CkptdCallback

    class Model(pl.LightningModule):
        def __init__(self, seed: int):
            super().__init__()
            torch.manual_seed(seed)
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=0.1)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}

    class StopAfter(pl.Callback):
        def __init__(self, step: int):
            self.step = step

        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == self.step:
                trainer.should_stop = True

    def fit(seed: int, callbacks: list):
        model = Model(seed)
        trainer = pl.Trainer(
            accelerator="cpu",
            max_steps=6,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=callbacks,
        )
        trainer.fit(model, DataLoader(TensorDataset(*data()), batch_size=BATCH))
        return model, trainer

    reference, _ = fit(0, [])
    root = str(tmp_path / "job")
    _, stopped = fit(0, [CkptdCallback(root, every_n_steps=2), StopAfter(2)])
    assert stopped.global_step == 2 and committed(root) == [2]
    cb = CkptdCallback(root, every_n_steps=2)
    resumed, trainer = fit(7, [cb])  # another init: everything must come from the checkpoint
    assert cb.restored_step == 2 and trainer.global_step == 6 and trainer.current_epoch == 3
    assert committed(root) == [2, 4, 6]
    assert torch.equal(resumed.net.weight, reference.net.weight)
    assert torch.equal(resumed.net.bias, reference.net.bias)
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 3  # stepped per epoch: 1 saved + 2


@pytest.mark.filterwarnings(
    r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning",
    # Lightning's hints about a small loader on the CPU; not about this code
    r"ignore:.*(does not have many workers|smaller than the logging interval).*",
    # what Lightning says of a plain loader resumed mid-epoch, and then trains on; the test is
    # whether the callback lets it
    r"ignore:You're resuming from a checkpoint that ended before the epoch ended",
)
def test_lightning_mid_epoch_resume_trains_each_sample_once_or_is_refused(tmp_path):
    """One process (``tests/distributed/test_lightning_elastic.py`` runs 2 -> 2 and 2 -> 3 under
    Lightning's DDP launcher): a job stopped after step 1 of 4 and resumed on ``CkptdCallback.loader``
    trains each sample of the epoch once; resumed on a plain ``DataLoader``, whose data Lightning
    starts over, it is refused instead of training the first batch again."""
    pl = pytest.importorskip(
        "lightning.pytorch", reason="the lightning extra is not installed (pip install -e .[lightning])"
    )
    from torch.utils.data import DataLoader

    from trainer_hooks.lightning import CkptdCallback

    seen: list[int] = []

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = IndexedNet()

        def training_step(self, batch, batch_idx):
            seen.extend(batch["idx"].tolist())
            return self.net(**batch)["loss"]

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.1)

    class StopAt1(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            trainer.should_stop = trainer.global_step == 1

    def fit(root, loader, stop: bool) -> CkptdCallback:
        cb = CkptdCallback(str(root), every_n_steps=1)
        trainer = pl.Trainer(
            accelerator="cpu",
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[cb, StopAt1()] if stop else [cb],
        )
        trainer.fit(Model(), loader(cb))
        return cb

    data = IndexedData(N)
    plain = lambda cb: DataLoader(data, batch_size=BATCH, shuffle=True)  # noqa: E731
    fit(tmp_path / "plain", plain, stop=True)
    with pytest.raises(RuntimeError, match=r"step 1 was saved after batch 1 of epoch 0.*CkptdCallback.loader"):
        fit(tmp_path / "plain", plain, stop=False)

    seen.clear()
    elastic = lambda cb: cb.loader(data, BATCH, seed=3)  # noqa: E731
    fit(tmp_path / "elastic", elastic, stop=True)
    assert len(seen) == BATCH and committed(str(tmp_path / "elastic")) == [1]
    assert fit(tmp_path / "elastic", elastic, stop=False).restored_step == 1
    assert sorted(seen) == list(range(N))


# ------------------------------------------------------------------------------------ HF


def _hf_stop_after(step: int):
    """A ``transformers.TrainerCallback`` that stops training at global step ``step``."""
    import transformers

    class StopAfter(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                control.should_training_stop = True

    return StopAfter()


def test_hf_trainer_saves_and_resumes(tmp_path):
    transformers = pytest.importorskip("transformers", reason="the hf extra is not installed (pip install -e .[hf])")
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (the hf extra)")

    from trainer_hooks.hf import CkptdCallback

    class Net(torch.nn.Module):
        def __init__(self, seed: int):
            super().__init__()
            torch.manual_seed(seed)
            self.fc = torch.nn.Linear(4, 1)

        def forward(self, x, labels=None):
            out = self.fc(x)
            return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}

    class Data(torch.utils.data.Dataset):
        def __init__(self):
            self.x, self.y = data()

        def __len__(self):
            return N

        def __getitem__(self, i):
            return {"x": self.x[i], "labels": self.y[i]}

    def fit(seed: int, callbacks: list, name: str):
        model = Net(seed)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / name),
            max_steps=6,
            per_device_train_batch_size=BATCH,
            learning_rate=0.1,
            lr_scheduler_type="linear",  # depends on the step: a wrong resume step would show
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            train_sampling_strategy="sequential",
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=0,
        )
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Data(), callbacks=callbacks)
        trainer.train()
        return model, trainer

    reference, _ = fit(0, [], "reference")
    root = str(tmp_path / "job")
    _, stopped = fit(0, [CkptdCallback(root, every_n_steps=2), _hf_stop_after(2)], "stopped")
    assert stopped.state.global_step == 2 and committed(root) == [2]
    cb = CkptdCallback(root, every_n_steps=2)
    resumed, trainer = fit(5, [cb], "resumed")  # another init: everything must come from the checkpoint
    assert cb.restored_step == 2 and trainer.state.global_step == 6
    assert committed(root) == [2, 4, 6]
    assert torch.equal(resumed.fc.weight, reference.fc.weight)
    assert torch.equal(resumed.fc.bias, reference.fc.bias)

    # saved after step 1 of an epoch's 2: the stock Trainer would start the epoch's data over
    mid = str(tmp_path / "mid")
    fit(0, [CkptdCallback(mid, every_n_steps=1), _hf_stop_after(1)], "mid_stopped")
    assert committed(mid) == [1]
    with pytest.raises(RuntimeError, match=r"step 1 was saved at epoch 0\.500.*ElasticTrainer"):
        fit(0, [CkptdCallback(mid, every_n_steps=1)], "mid_resumed")


# ------------------------------------------------------------------------------ HF ElasticTrainer


def _elastic_setup(tmp_path):
    transformers = pytest.importorskip("transformers", reason="the hf extra is not installed (pip install -e .[hf])")
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (the hf extra)")
    from trainer_hooks.hf import ElasticTrainer

    n = 10  # 5 batches of 2 an epoch: with 2 accumulation steps, optimizer steps of 2, 2 and 1 batches

    def fit(seed: int, name: str, root: str, callbacks=(), **overrides):
        model = IndexedNet(seed)
        options = dict(
            output_dir=str(tmp_path / name),
            num_train_epochs=2,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            learning_rate=0.1,
            lr_scheduler_type="linear",  # its length is the step budget: a wrong budget would show
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            seed=3,
        )
        options.update(overrides)
        args = transformers.TrainingArguments(**options)
        trainer = ElasticTrainer(
            model=model,
            args=args,
            train_dataset=IndexedData(n),
            callbacks=list(callbacks),
            ckptd_root=root,
            ckptd_every_n_steps=1,
        )
        trainer.train()
        return model, trainer

    return transformers, fit, n


def test_hf_elastic_trainer_resumes_mid_epoch_with_accumulation(tmp_path):
    """One process, 2 epochs by count, 2 accumulation steps: a run stopped after its first
    optimizer step (4 of the epoch's 10 samples) and resumed from ckptd trains on the other 6,
    then the next epoch, and ends bitwise where an uninterrupted run ends: the resumed epoch's
    short last accumulation, the epoch budget and the LR schedule's length all come out the same."""
    _, fit, n = _elastic_setup(tmp_path)
    reference, ref_trainer = fit(0, "reference", str(tmp_path / "ref_job"))
    assert ref_trainer.state.global_step == 6  # 3 optimizer steps an epoch
    root = str(tmp_path / "job")
    stopped, _ = fit(0, "stopped", root, callbacks=[_hf_stop_after(1)])
    assert committed(root) == [1] and len(stopped.seen) == 4
    resumed, trainer = fit(9, "resumed", root)  # another init: everything must come from the checkpoint
    assert trainer.ckptd.restored_step == 1 and trainer.state.global_step == 6
    assert sorted(stopped.seen + resumed.seen[:6]) == list(range(n))  # epoch 0, each sample once
    assert sorted(resumed.seen[6:]) == list(range(n))  # then all of epoch 1
    assert resumed.seen == reference.seen[4:]  # in the order of the uninterrupted run
    assert torch.equal(resumed.fc.weight, reference.fc.weight)
    assert torch.equal(resumed.fc.bias, reference.fc.bias)
    assert committed(root) == [1, 2, 3, 4, 5, 6]


def test_hf_elastic_trainer_refuses_what_would_break_the_position(tmp_path):
    from ckptd.errors import CheckpointError

    transformers, fit, _ = _elastic_setup(tmp_path)
    with pytest.raises(ValueError, match="group_by_length"):
        fit(0, "grouped", str(tmp_path / "a"), train_sampling_strategy="group_by_length")
    from trainer_hooks import Checkpointer
    from trainer_hooks.hf import ElasticTrainer

    trainer = ElasticTrainer(
        model=torch.nn.Linear(4, 1),
        args=transformers.TrainingArguments(output_dir=str(tmp_path / "o"), use_cpu=True, report_to=[]),
        train_dataset=torch.utils.data.TensorDataset(torch.zeros(4, 4)),
        ckptd_root=str(tmp_path / "b"),
    )
    with pytest.raises(ValueError, match="resume_from_checkpoint"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "o"))

    # a root that CkptdCallback saved holds no sampler position: refused, naming the key
    root = str(tmp_path / "callback_job")
    ckpt = Checkpointer(root)
    ckpt.save(1, {"model": torch.nn.Linear(4, 1)})
    ckpt.close()
    with pytest.raises(CheckpointError, match="sampler"):
        fit(0, "from_callback_root", root)


def test_hf_elastic_trainer_start_refuses_uneven_batch_counts_and_skips_a_finished_epoch():
    """ElasticTrainer's check when training starts (``trainer_hooks.hf._start_epoch``), for each
    rank of a 3-rank job, without the job: a rest of the epoch that deals one rank a batch more is
    refused (DDP would wait forever at the tail); a finished epoch moves on to the next."""
    pytest.importorskip("transformers", reason="the hf extra is not installed (pip install -e .[hf])")
    from trainer_hooks import ElasticSampler
    from trainer_hooks.hf import _start_epoch

    def at(n: int, position: int, rank: int, drop_last: bool = False) -> ElasticSampler:
        sampler = ElasticSampler(n, seed=5, drop_last=drop_last, rank=rank, num_replicas=3)
        sampler.load_state_dict({**sampler.state_dict(), "position": position})
        return sampler

    for rank in range(3):
        ok = at(34, 16, rank)  # 18 left: 3 batches of 2 on every rank; a whole epoch: 6 each
        _start_epoch(ok, 2)
        assert (ok.epoch, ok.position) == (0, 16)
        with pytest.raises(ValueError, match=r"20 samples left of epoch 0 give 3 ranks \[4, 4, 3\] batches of 2"):
            _start_epoch(at(36, 16, rank), 2)  # 7, 7, 6 samples left
        done = at(36, 34, rank, drop_last=True)  # 2 left: nothing for anyone, the epoch is over
        _start_epoch(done, 2)
        assert (done.epoch, done.position) == (1, 0)
