"""Reading a checkpoint without torch: its arrays as tensorstore handles or a zarr-python group.

Every tensor is a zarr v3 array of its global shape, so tensorstore and zarr-python could open
it alone, but they do not know which steps are committed and they trust the folder (links,
FIFOs, ``/dev/zero``, any codec a ``zarr.json`` names). So both helpers resolve a committed step
(``catalog.resolve_step``), check each array's ``zarr.json`` as ``ckptd verify`` does
(``codec.check_metadata``) before a handle to it exists, and read every byte through ckptd's own
store: ``open_array`` a ``tensorstore.virtual_chunked`` over ``reader.CheckpointReader``,
``open_group`` zarr-python over :class:`ConfinedZarrStore`, which serves only the checkpoint's
own keys (group nodes, checked ``zarr.json``, chunk objects) and refuses an object larger than
its layout allows, a range longer than a chunk or an index, and anything that is not a regular
file below the root (the attacks and what holds: ``docs/security.md``, "Torch-free readers").

Checks happen at each read, not once at open, so a file swapped for a link afterwards is still
refused. S3 settings come from the variables boto3 reads (``AWS_ENDPOINT_URL_S3`` /
``AWS_ENDPOINT_URL``, ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``). Nothing here imports torch.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any
from urllib.parse import unquote, urlsplit

from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest
from zarr.abc.store import Store as ZarrStore
from zarr.core.buffer.core import default_buffer_prototype

from ckptd import catalog
from ckptd import manifest as mf
from ckptd.codec import CRC_BYTES, check_metadata, crc_bytes, max_object_bytes
from ckptd.errors import CheckpointError, CorruptChunkError
from ckptd.layout import Box
from ckptd.reader import CheckpointReader, ReadRequest
from ckptd.verify import check_object
from storage_backends import NotFoundError, StorageError, Store, open_store

__all__ = ["ConfinedZarrStore", "kvstore_spec", "open_array", "open_group"]


def _location(uri: str) -> tuple[str, str, str]:
    """(``file`` or ``s3``, bucket or "", absolute path or key prefix without a trailing slash)."""
    parts = urlsplit(uri)
    if parts.scheme in ("", "file"):
        path = unquote(parts.path) if parts.scheme == "file" else uri
        return "file", "", os.path.abspath(path)
    if parts.scheme == "s3":
        return "s3", parts.netloc, parts.path.strip("/")
    raise CheckpointError(f"{uri}: open_array/open_group read file paths and s3:// URIs, not {parts.scheme}://")


def _resolve(uri: str, step: int | None) -> tuple[Store, int, mf.Manifest]:
    """The store (left open: the handle reads through it), the committed step and its manifest."""
    _location(uri)
    try:
        store = open_store(uri)
    except (StorageError, ValueError) as e:
        raise CheckpointError(f"{uri}: {e}") from None
    try:
        s = catalog.resolve_step(store, step)
        return store, s, catalog.load_manifest(store, s)
    except StorageError as e:
        store.close()
        raise CheckpointError(f"{uri}: {e}") from None
    except BaseException:
        store.close()
        raise


def _checked_metadata(store: Store, folder: str, entry: mf.TensorEntry, where: str) -> dict:
    """The array's ``zarr.json``, read capped and checked as ``ckptd verify`` checks it."""
    try:
        meta = mf.read_json(store, f"{folder}/{entry.path}/zarr.json", where, "zarr.json")
        check_metadata(meta, entry.layout, entry.value)
    except NotFoundError:
        raise CheckpointError(f"{where}: array {entry.key!r}: zarr.json is missing") from None
    except StorageError as e:
        raise CheckpointError(f"{where}: array {entry.key!r}: cannot read zarr.json ({e})") from None
    except CheckpointError as e:
        raise CheckpointError(f"{where}: array {entry.key!r}: refusing to open it: {e}") from None
    return meta


def kvstore_spec(uri: str, path: str, endpoint: str = "") -> dict[str, Any]:
    """The tensorstore kvstore spec of ``path`` (a folder relative to the job root ``uri``).
    For trusted roots only: tensorstore's own drivers follow links and decode any codec."""
    kind, bucket, prefix = _location(uri)
    if kind == "file":
        return {"driver": "file", "path": os.path.join(prefix, path) + "/"}
    key = "/".join(p.strip("/") for p in (prefix, path) if p.strip("/"))
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": key + "/", "aws_region": region}
    if endpoint:
        spec["endpoint"] = endpoint
    spec["context"] = {"aws_credentials": _aws_credentials()}
    return spec


def _aws_credentials() -> dict[str, str]:
    """tensorstore's credentials provider: the one the environment names, as boto3 would pick it.
    Its default chain parses ``~/.aws/config`` and ``credentials`` even when the keys are in the
    environment, and logs a few dozen errors per read where those files do not exist (issue 28)."""
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        return {"type": "environment"}
    if os.environ.get("AWS_PROFILE"):
        return {"type": "profile", "profile": os.environ["AWS_PROFILE"]}
    return {"type": "default"}


def open_array(uri: str, key: str, step: int | None = None):
    """A read-only ``tensorstore.TensorStore`` over the array ``key`` (as ``ckptd show`` lists it,
    e.g. ``model/layers.0.weight``) of the committed ``step`` (the latest when None).

    Indexing it reads only the chunks needed: ``open_array(uri, key)[0:8].read().result()`` is a
    numpy array (bfloat16 as ``ml_dtypes.bfloat16``). Raises ``CheckpointError`` when the step is
    not committed, the key is not in it, or its ``zarr.json`` is not what ckptd writes; a read
    of a chunk that is corrupt, missing, oversized or not a regular file below the root fails
    with tensorstore's error carrying ckptd's message."""
    import tensorstore as ts

    store, s, m = _resolve(uri, step)
    where, folder = catalog.where(store, s), mf.step_dir(s)
    entry = m.tensors.get(key)
    try:
        if entry is None:
            near = sorted(k for k in m.tensors if k.split("/")[0] == key.split("/")[0])[:5]
            hint = f"; keys like it: {', '.join(near)}" if near else f"; it has {len(m.tensors)} arrays (ckptd show)"
            raise CheckpointError(f"{where}: no array {key!r}{hint}")
        _checked_metadata(store, folder, entry, where)
    except BaseException:
        store.close()
        raise
    layout = entry.layout
    reader = CheckpointReader(store, folder, where)

    def read(domain, array, _params) -> None:
        reader.read([ReadRequest(entry, Box(tuple(domain.inclusive_min), tuple(domain.exclusive_max)), array)])

    return ts.virtual_chunked(
        read,
        dtype=ts.dtype(layout.np_dtype),
        domain=ts.IndexDomain(shape=layout.shape),
        chunk_layout=ts.ChunkLayout(read_chunk_shape=layout.chunk_shape),
    )


def open_group(uri: str, step: int | None = None):
    """The committed ``step`` (the latest when None) as a read-only zarr-python group; its
    arrays are ``group["arrays/model/layers.0.weight"]``. It reads through ckptd's own store
    (:class:`ConfinedZarrStore`), on a local root and on S3 alike; opening an array whose
    ``zarr.json`` is not what ckptd writes raises ``CheckpointError``. zarr-python has no
    bfloat16 data type: open those arrays with :func:`open_array`."""
    import zarr

    store, s, m = _resolve(uri, step)
    try:
        return zarr.open_group(store=ConfinedZarrStore(store, s, m), mode="r")
    except (ValueError, FileNotFoundError, KeyError) as e:
        store.close()
        raise CheckpointError(f"{uri} step {s}: zarr cannot open the checkpoint folder: {e}") from None


class ConfinedZarrStore(ZarrStore):
    """A read-only zarr-python store over one committed checkpoint folder of a ckptd ``Store``;
    what it serves and refuses is in the module docstring. An array's ``zarr.json`` is served
    from the checked copy, so it cannot change under zarr. A refusal raises ``CheckpointError``."""

    supports_writes = False
    supports_deletes = False
    supports_partial_writes = False
    supports_listing = True

    def __init__(self, store: Store, step: int, manifest: mf.Manifest) -> None:
        super().__init__(read_only=True)
        self._store = store
        self._folder = mf.step_dir(step)
        self._where = catalog.where(store, step)
        self._arrays = {e.path: e for e in manifest.tensors.values()}
        self._groups = {""} | {
            "/".join(parts[:i]) for p in self._arrays for parts in [p.split("/")] for i in range(1, len(parts))
        }
        self._meta: dict[str, bytes] = {}

    def __eq__(self, other: object) -> bool:
        return other is self

    __hash__ = object.__hash__

    def __str__(self) -> str:
        return f"{self._store.uri.rstrip('/')}/{self._folder}"

    def with_read_only(self, read_only: bool = False):
        if not read_only:
            raise CheckpointError(f"{self}: a committed checkpoint is read-only")
        return self

    def _node(self, key: str) -> bytes | None:
        """The bytes of a ``zarr.json`` key: a checked group node or array metadata; None for a
        key the checkpoint has no node at."""
        path = key[: -len("zarr.json")].rstrip("/")
        if path in self._meta:
            return self._meta[path]
        if path in self._arrays:
            data = mf.dumps(_checked_metadata(self._store, self._folder, self._arrays[path], self._where))
        elif path in self._groups:
            try:
                node = mf.read_json(self._store, f"{self._folder}/{key}", self._where, "group zarr.json")
            except NotFoundError:
                return None
            if not isinstance(node, dict) or node.get("node_type") != "group" or node.get("zarr_format") != 3:
                raise CheckpointError(f"{self._where}: {key} is not a zarr v3 group node")
            attrs = node.get("attributes")
            data = mf.group_metadata(attrs if isinstance(attrs, dict) else {})
        else:
            return None
        self._meta[path] = data
        return data

    def _chunk(self, key: str) -> tuple[mf.TensorEntry, tuple[int, ...]] | None:
        """The array whose chunk object ``key`` is and its coordinates, if it is one of its grid."""
        if key.endswith("/c"):
            path, coords = key[:-2], []
        else:
            path, sep, rest = key.rpartition("/c/")
            if not sep:
                return None
            coords = rest.split("/")
            if not all(c.isascii() and c.isdigit() and len(c) < 12 for c in coords):
                return None
        entry = self._arrays.get(path)
        if entry is None or len(coords) != len(entry.layout.shape):
            return None
        if not all(int(c) < g for c, g in zip(coords, entry.layout.grid_shape, strict=True)):
            return None
        return entry, tuple(map(int, coords))

    def _get(self, key: str, byte_range) -> bytes | None:
        if key == "zarr.json" or key.endswith("/zarr.json"):
            data = self._node(key)
            if data is None or byte_range is None:
                return data
            raise CheckpointError(f"{self._where}: a byte range of {key} was asked for")
        hit = self._chunk(key)
        if hit is None:
            return None
        entry, coord = hit
        layout, full = entry.layout, f"{self._folder}/{key}"
        longest = max(layout.chunk_nbytes + CRC_BYTES, layout.index_nbytes if layout.sharded else 0)
        name = f"{self._where}: {key}"
        try:
            if byte_range is None:
                data = self._store.get(full, limit=max_object_bytes(layout))
                check_object(layout, memoryview(data), coord, name, strict=False)
                return data
            if isinstance(byte_range, RangeByteRequest):
                start, length = byte_range.start, byte_range.end - byte_range.start
            elif isinstance(byte_range, SuffixByteRequest):
                start, length = -byte_range.suffix, byte_range.suffix
            elif isinstance(byte_range, OffsetByteRequest):
                start, length = byte_range.offset, self._store.head(full).size - byte_range.offset
            else:
                raise CheckpointError(f"{self._where}: unknown byte range {byte_range!r}")
            if not 0 <= length <= longest:
                raise CheckpointError(
                    f"{self._where}: {key}: a read of {length} bytes asked for; a chunk or an index of "
                    f"this array is at most {longest}"
                )
            data = self._store.get_range(full, start, length)
            # a chunk and a shard index alike end in their crc32c, checked here so that zarr never
            # meets a corrupt one (it would raise a ValueError)
            if len(data) < CRC_BYTES or crc_bytes(memoryview(data)[:-CRC_BYTES]) != data[-CRC_BYTES:]:
                raise CorruptChunkError(f"{name}: crc32c mismatch (corrupt chunk or shard index)")
            return data
        except NotFoundError:
            if entry.value is not None or layout.nbytes == 0:
                return None  # an inline scalar or an empty array: no chunk object, by design
            # zarr would read an absent chunk as zeros: in a committed checkpoint it is damage
            raise CheckpointError(
                f"{self._where}: {key}: missing, or not a regular file reached without a link"
            ) from None
        except StorageError as e:
            raise CheckpointError(f"{self._where}: {key}: {e}") from None

    async def get(self, key: str, prototype=None, byte_range=None):
        data = await asyncio.to_thread(self._get, key, byte_range)
        if data is None:
            return None
        return (prototype or default_buffer_prototype()).buffer.from_bytes(data)

    async def get_partial_values(self, prototype, key_ranges):
        return [await self.get(key, prototype, byte_range) for key, byte_range in key_ranges]

    async def exists(self, key: str) -> bool:
        return await self.get(key) is not None

    async def set(self, key: str, value, byte_range=None) -> None:
        raise CheckpointError(f"{self}: a committed checkpoint is read-only")

    async def delete(self, key: str) -> None:
        raise CheckpointError(f"{self}: a committed checkpoint is read-only")

    def _listing(self, prefix: str) -> list[str]:
        keys = {"zarr.json"} | {f"{g}/zarr.json" for g in self._groups if g}
        keys |= {f"{p}/zarr.json" for p in self._arrays}
        return sorted(k for k in keys if k.startswith(prefix))

    def list(self):
        return self.list_prefix("")

    async def list_prefix(self, prefix: str):
        for k in self._listing(prefix):
            yield k

    async def list_dir(self, prefix: str):
        prefix = prefix.rstrip("/") + "/" if prefix.strip("/") else ""
        for head in dict.fromkeys(k[len(prefix) :].split("/", 1)[0] for k in self._listing(prefix)):
            yield head
