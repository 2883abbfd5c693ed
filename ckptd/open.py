"""Reading a checkpoint without torch: its arrays as tensorstore handles or a zarr-python group.

Every tensor of a checkpoint is a zarr v3 array of its global shape (``manifest.py``), so
tensorstore's ``zarr3`` driver and zarr-python open it with no code of ours; what they cannot
know is which step folders are committed. Both helpers therefore resolve the step through
``catalog.resolve_step`` first (the latest committed step when ``step`` is None; a partial or
missing step is a ``CheckpointNotFoundError``) and only then hand out a read-only handle.

S3 settings come from the variables boto3 reads (``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``,
``AWS_REGION`` / ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``). Nothing here imports torch.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import unquote, urlsplit

from ckptd import catalog
from ckptd import manifest as mf
from ckptd.errors import CheckpointError
from storage_backends import StorageError, open_store

__all__ = ["kvstore_spec", "open_array", "open_group"]


def _location(uri: str) -> tuple[str, str, str]:
    """(``file`` or ``s3``, bucket or "", absolute path or key prefix without a trailing slash)."""
    parts = urlsplit(uri)
    if parts.scheme in ("", "file"):
        path = unquote(parts.path) if parts.scheme == "file" else uri
        return "file", "", os.path.abspath(path)
    if parts.scheme == "s3":
        return "s3", parts.netloc, parts.path.strip("/")
    raise CheckpointError(f"{uri}: open_array/open_group read file paths and s3:// URIs, not {parts.scheme}://")


def _resolve(uri: str, step: int | None) -> tuple[int, mf.Manifest, str]:
    """The committed step, its manifest and the S3 endpoint the store resolved (or "")."""
    try:
        store = open_store(uri)
    except (StorageError, ValueError) as e:
        raise CheckpointError(f"{uri}: {e}") from None
    with store:
        try:
            s = catalog.resolve_step(store, step)
            m = catalog.load_manifest(store, s)
        except StorageError as e:
            raise CheckpointError(f"{uri}: {e}") from None
        return s, m, getattr(store, "endpoint_url", "") or ""


def _region() -> str:
    return os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"


def _join(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p.strip("/"))


def kvstore_spec(uri: str, path: str, endpoint: str = "") -> dict[str, Any]:
    """The tensorstore kvstore spec of ``path`` (a folder relative to the job root ``uri``)."""
    kind, bucket, prefix = _location(uri)
    if kind == "file":
        return {"driver": "file", "path": os.path.join(prefix, path) + "/"}
    spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": _join(prefix, path) + "/"}
    spec["aws_region"] = _region()
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
    not committed or the key is not in it."""
    import tensorstore as ts

    s, m, endpoint = _resolve(uri, step)
    entry = m.tensors.get(key)
    if entry is None:
        near = sorted(k for k in m.tensors if k.split("/")[0] == key.split("/")[0])[:5]
        hint = f"; keys like it: {', '.join(near)}" if near else f"; it has {len(m.tensors)} arrays (ckptd show)"
        raise CheckpointError(f"{catalog.where(open_store(uri), s)}: no array {key!r}{hint}")
    spec = {"driver": "zarr3", "kvstore": kvstore_spec(uri, f"{mf.step_dir(s)}/{entry.path}", endpoint)}
    try:
        return ts.open(spec, read=True, write=False, open=True).result()
    except ValueError as e:
        raise CheckpointError(f"{uri} step {s}: tensorstore cannot open array {key!r}: {e}") from None


def open_group(uri: str, step: int | None = None):
    """The committed ``step`` (the latest when None) as a read-only zarr-python group; its
    arrays are ``group["arrays/model/layers.0.weight"]``. Local roots use zarr's ``LocalStore``;
    S3 roots zarr's ``ObjectStore`` over ``obstore`` (``pip install obstore``, in the ``s3``
    extra). zarr-python has no bfloat16 data type: open those arrays with :func:`open_array`."""
    import zarr

    s, _, endpoint = _resolve(uri, step)
    kind, bucket, prefix = _location(uri)
    folder = mf.step_dir(s)
    if kind == "file":
        store = zarr.storage.LocalStore(os.path.join(prefix, folder), read_only=True)
    else:
        try:
            from obstore.store import S3Store
        except ImportError:
            raise CheckpointError(
                "open_group on s3:// needs obstore (pip install obstore, or ckptd[s3]); open_array reads S3 without it"
            ) from None
        env = os.environ
        config = {"region": _region()}
        for name, var in (
            ("access_key_id", "AWS_ACCESS_KEY_ID"),
            ("secret_access_key", "AWS_SECRET_ACCESS_KEY"),
            ("session_token", "AWS_SESSION_TOKEN"),
        ):
            if env.get(var):
                config[name] = env[var]
        if endpoint:
            config["endpoint"] = endpoint
        client = {"allow_http": True} if endpoint.startswith("http://") else None
        s3 = S3Store(bucket, prefix=_join(prefix, folder), config=config, client_options=client)
        store = zarr.storage.ObjectStore(s3, read_only=True)
    try:
        return zarr.open_group(store=store, mode="r")
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise CheckpointError(f"{uri} step {s}: zarr cannot open the checkpoint folder: {e}") from None
