"""What runs inside a training process: ``Checkpointer``, ``CheckpointHook``, ``ElasticSampler``.

Lightning and Hugging Face callbacks live in ``trainer_hooks.lightning`` and ``trainer_hooks.hf``
and import their frameworks lazily.
"""

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
