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


def open_array(uri: str, key: str, step: int | None = None):
    """A read-only tensorstore handle on one array of a committed checkpoint (``ckptd.open``)."""
    from ckptd.open import open_array as _open_array

    return _open_array(uri, key, step)


def open_group(uri: str, step: int | None = None):
    """A committed checkpoint as a read-only zarr-python group (``ckptd.open``)."""
    from ckptd.open import open_group as _open_group

    return _open_group(uri, step)


__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CorruptChunkError",
    "FORMAT_VERSION",
    "StateMismatchError",
    "__version__",
    "open_array",
    "open_group",
]
