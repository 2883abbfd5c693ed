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

from trainer_hooks.checkpointer import Checkpointer


def _named(prefix: str, objs: list) -> dict[str, Any]:
    return {prefix if i == 0 else f"{prefix}_{i}": o for i, o in enumerate(objs)}


class CkptdCallback(Callback):
    def __init__(
        self,
        root_uri: str,
        every_n_steps: int = 100,
        *,
        daemon: str | None = None,
        keep_last: int | None = None,
        extra_state: dict[str, Any] | None = None,
        restore: bool = True,
        save_on_train_end: bool = True,
    ):
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.root_uri = root_uri
        self.every_n_steps = every_n_steps
        self.daemon = daemon
        self.keep_last = keep_last
        self.extra_state = dict(extra_state or {})
        self.restore = restore
        self.save_on_train_end = save_on_train_end
        self.ckpt: Checkpointer | None = None
        self.restored_step: int | None = None
        self.last_saved: int | None = None

    def state(self, trainer, pl_module) -> dict[str, Any]:
        """What is saved and restored (the names are the checkpoint's state keys)."""
        state: dict[str, Any] = {"model": pl_module}
        state.update(_named("optim", list(trainer.optimizers)))
        state.update(_named("sched", [cfg.scheduler for cfg in trainer.lr_scheduler_configs]))
        state["loops"] = trainer.fit_loop
        state.update(self.extra_state)
        return state

    def on_fit_start(self, trainer, pl_module) -> None:
        self.ckpt = Checkpointer(self.root_uri, daemon=self.daemon, keep_last=self.keep_last)
        if self.restore:
            self.restored_step = self.ckpt.restore(self.state(trainer, pl_module))
            self.last_saved = self.restored_step

    def _save(self, trainer, pl_module) -> None:
        step = trainer.global_step
        if self.ckpt is None or step == self.last_saved:
            return
        self.ckpt.save(step, self.state(trainer, pl_module))
        self.last_saved = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step > 0 and trainer.global_step % self.every_n_steps == 0:
            self._save(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.ckpt is None:
            return
        if self.save_on_train_end and trainer.global_step > 0:
            self._save(trainer, pl_module)
        self.ckpt.wait()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self.ckpt is not None:
            self.ckpt.close()
            self.ckpt = None
