"""ckptd: layout-independent checkpoints (one global Zarr v3 array per tensor) on object storage.

The format lives here (``manifest``, ``codec``, ``layout``, ``catalog``); what runs inside a
training process lives in ``trainer_hooks``; object stores in ``storage_backends``.
"""

from ckptd.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptChunkError,
    StateMismatchError,
)

__version__ = "0.1.0"
FORMAT_VERSION = 1

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CorruptChunkError",
    "FORMAT_VERSION",
    "StateMismatchError",
    "__version__",
]
