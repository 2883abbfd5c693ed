"""What runs inside a training process: ``Checkpointer``, ``CheckpointHook``, ``ElasticSampler``.

Lightning and Hugging Face callbacks live in ``trainer_hooks.lightning`` and ``trainer_hooks.hf``
and import their frameworks lazily.
"""

try:
    import torch  # noqa: F401  (the one clear error for a missing torch, before any other import)
except ModuleNotFoundError as e:
    if e.name != "torch":
        raise
    raise ModuleNotFoundError(
        "trainer_hooks needs torch (it runs inside the training process): install your torch first "
        "(e.g. pip install torch==2.13.0), then pip install 'ckptd[torch]'. Operations (ckptd ls/verify/"
        "gc/serve, ckptd.open_array, ckptd.open_group) need no torch.",
        name="torch",
    ) from None

from ckptd.errors import CheckpointError, CheckpointNotFoundError, CorruptChunkError, StateMismatchError
from trainer_hooks.checkpointer import Checkpointer
from trainer_hooks.sampler import ElasticSampler, StatefulLoader

__all__ = [
    "CheckpointError",
    "CheckpointHook",
    "CheckpointNotFoundError",
    "Checkpointer",
    "CorruptChunkError",
    "ElasticSampler",
    "StateMismatchError",
    "StatefulLoader",
]


def __getattr__(name):  # CheckpointHook pulls in signal handling only when used
    if name == "CheckpointHook":
        from trainer_hooks.hook import CheckpointHook

        return CheckpointHook
    raise AttributeError(name)
