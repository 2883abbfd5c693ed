"""Object-store backends for ckptd, chosen by URI scheme.

``open_store("/abs/path")``, ``open_store("file:///abs/path")``, ``open_store("memory://name")``,
``open_store("s3://bucket/prefix")``.
"""

from storage_backends._direct import DIRECT_MIN_BYTES  # the local store writes objects this large with O_DIRECT
from storage_backends.base import (
    Data,
    ExistsError,
    InvalidKeyError,
    NotFoundError,
    ObjectInfo,
    StorageError,
    Store,
)
from storage_backends.local import LocalStore
from storage_backends.memory import MemoryStore
from storage_backends.registry import UnknownSchemeError, open_store, register_scheme

# S3Store (storage_backends.s3) is not imported here: boto3 loads only when an s3:// URI is opened.

__all__ = [
    "DIRECT_MIN_BYTES",
    "Data",
    "ExistsError",
    "InvalidKeyError",
    "LocalStore",
    "MemoryStore",
    "NotFoundError",
    "ObjectInfo",
    "StorageError",
    "Store",
    "UnknownSchemeError",
    "open_store",
    "register_scheme",
]
