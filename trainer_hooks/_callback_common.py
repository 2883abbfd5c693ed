"""What the Lightning and Hugging Face callbacks share: options, opening the Checkpointer and
restoring, saving a step once, and closing. Framework-free: :mod:`trainer_hooks.lightning` and
:mod:`trainer_hooks.hf` import their framework themselves and mix this class into its callback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainer_hooks.checkpointer import Checkpointer


class CheckpointCallbackBase:
    """The ckptd side of a trainer callback; the subclass says what ``state`` is and when."""

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

    def _open(self, state: Callable[[], dict[str, Any]]) -> None:
        """Open the Checkpointer and, if asked, restore the latest committed step into ``state()``."""
        self.ckpt = Checkpointer(self.root_uri, daemon=self.daemon, keep_last=self.keep_last)
        if self.restore:
            self.restored_step = self.ckpt.restore(state())
            self.last_saved = self.restored_step

    def _due(self, step: int) -> bool:
        return step > 0 and step % self.every_n_steps == 0

    def _save_step(self, step: int, state: Callable[[], dict[str, Any]]) -> None:
        """Save ``state()`` at ``step`` unless it is already saved (or no Checkpointer is open)."""
        if self.ckpt is None or step == self.last_saved:
            return
        self.ckpt.save(step, state())
        self.last_saved = step

    def _finish(self, step: int, state: Callable[[], dict[str, Any]]) -> None:
        """At the end of training: save the last step if asked and not yet saved, wait for commits."""
        if self.ckpt is None:
            return
        if self.save_on_train_end and step > 0:
            self._save_step(step, state)
        self.ckpt.wait()

    def _close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()
            self.ckpt = None
