"""A Lightning ``Callback`` that saves through :class:`~trainer_hooks.Checkpointer` every N
optimizer steps and restores the latest committed checkpoint when fitting starts, at any world
size (``pip install 'ckptd[lightning]'``; ``lightning.pytorch`` or the older
``pytorch_lightning``)::

    trainer = lightning.pytorch.Trainer(callbacks=[CkptdCallback("s3://bucket/job", every_n_steps=500)], ...)
    trainer.fit(model, data)        # resumes from the latest committed step, if any

What is saved: the LightningModule (``model``), its optimizers (``optim``; ``optim_1``, ... if
several), their LR schedulers (``sched``, ...), Lightning's fit-loop progress (``loops``: epoch,
global step, batch position, as Lightning's own checkpoints keep it) and ``extra_state`` (objects
with ``state_dict``/``load_state_dict``, such as an ``ElasticSampler``). Modules go through
``torch.distributed.checkpoint.state_dict``, so DDP and FSDP strategies save FQN-keyed, sharded
state that restores at any other world size.

Order of hooks, on every rank (saves and restores are collective): ``on_fit_start`` opens the
Checkpointer and restores (after the strategy has wrapped the model and built the optimizers,
before the fit loop runs -- where Lightning restores its own ``ckpt_path``);
``on_train_batch_end`` saves when ``trainer.global_step`` reaches a multiple of ``every_n_steps``;
``on_train_end`` saves the last step if it was not saved and waits for the commit; ``teardown``
closes. Do not also pass ``ckpt_path`` to ``fit``: two restores would fight.
"""

from __future__ import annotations

from typing import Any

try:
    from lightning.pytorch import Callback
except ImportError:  # pragma: no cover - the older package name
    try:
        from pytorch_lightning import Callback
    except ImportError:
        raise ImportError(
            "trainer_hooks.lightning needs Lightning: pip install 'ckptd[lightning]' (lightning or pytorch_lightning)"
        ) from None

from trainer_hooks._callback_common import CheckpointCallbackBase

__all__ = ["CkptdCallback"]


def _named(prefix: str, objs: list) -> dict[str, Any]:
    return {prefix if i == 0 else f"{prefix}_{i}": o for i, o in enumerate(objs)}


class CkptdCallback(CheckpointCallbackBase, Callback):
    def state(self, trainer, pl_module) -> dict[str, Any]:
        """What is saved and restored (the names are the checkpoint's state keys)."""
        state: dict[str, Any] = {"model": pl_module}
        state.update(_named("optim", list(trainer.optimizers)))
        state.update(_named("sched", [cfg.scheduler for cfg in trainer.lr_scheduler_configs]))
        state["loops"] = trainer.fit_loop
        state.update(self.extra_state)
        return state

    def on_fit_start(self, trainer, pl_module) -> None:
        self._open(lambda: self.state(trainer, pl_module))

    def _save(self, trainer, pl_module) -> None:
        self._save_step(trainer.global_step, lambda: self.state(trainer, pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._due(trainer.global_step):
            self._save(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self._finish(trainer.global_step, lambda: self.state(trainer, pl_module))

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._close()
