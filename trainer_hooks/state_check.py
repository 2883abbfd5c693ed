"""What the live state and a checkpoint must agree on before a restore reads a byte of it.

``validate`` runs on every rank, after the manifest is loaded and the live state flattened
(``trainer_hooks.restore``, step 3), and before any chunk is read: a mismatch is the caller's
(wrong model, wrong optimizer, another run's checkpoint) and is refused up front with a
``StateMismatchError`` naming the checkpoint, the key and what differs, so that neither the
state nor the reads are touched. It is pure (no storage, no collective): every rank holds the
same manifest and flattens the same kind of state, so every rank reaches the same verdict.

What is compared: only the top-level entries the state has (``{"model": m}`` from a full
training checkpoint is no error); inside each, keys (``strict``), each value's kind against the
kinds it can be restored from (``_COMPATIBLE``), global shapes and dtypes. Optimizer state a
fresh optimizer makes for parameters the saved one kept none for is not asked of the checkpoint
(``_stateless_params``); a ``$tensor`` reference the manifest's tensor table lacks is refused
rather than silently skipped.
"""

from __future__ import annotations

from ckptd import jsonenc
from ckptd import manifest as mf
from ckptd.dtypes import zarr_dtype
from ckptd.errors import CheckpointError, StateMismatchError

__all__ = ["validate"]


# What a live value of each kind can be restored from: a module from a plain dict of tensors
# (``ckptd import`` of a torch.save/safetensors file), and so on.
_COMPATIBLE = {
    "module": {"module", "dict"},
    "optimizer": {"optimizer", "dict"},
    "dict": {"dict", "module", "optimizer"},
    "stateful": {"stateful", "dict", "value"},
    "tensor": {"tensor"},
    "value": {"value", "dict", "stateful"},
}


def _entry_of(key: str) -> str:
    """The escaped top-level state name of an array key (``key_of`` escapes each component)."""
    return key.split("/", 1)[0]


def _stateless_params(m: mf.Manifest, flat) -> set[str]:
    """The live array keys of optimizer state for parameters that the checkpoint's optimizer
    had in its parameter groups but kept no state for: a BERT pooler the loss never reaches,
    frozen layers that keep ``requires_grad``, MoE experts no token was routed to, a head used
    later in training. ``get_optimizer_state_dict`` on a fresh optimizer makes state for every
    parameter (a zero-gradient step), so the live state has these keys and the checkpoint does
    not; they are restored as they were saved: with no state."""
    out: set[str] = set()
    for name, node in flat.tree.items():
        saved = m.state.get(name)
        if node["kind"] != "optimizer" or saved is None or saved["kind"] != "optimizer":
            continue
        saved_state = saved["data"].get("state", {})
        groups = jsonenc.decode(saved["data"].get("param_groups", []), lambda k: None)
        in_groups = {p for g in groups if isinstance(g, dict) for p in g.get("params", ())}
        for fqn in node["data"].get("state", {}):
            if fqn not in saved_state and fqn in in_groups:
                prefix = mf.key_of((name, "state", fqn)) + "/"
                out.update(k for k in flat.tensors if k.startswith(prefix))
    return out


def _refuse_mismatch(where: str, keys: set[str], what: str, lenient: str) -> None:
    """StateMismatchError naming the first of ``keys`` (sorted) and how many more, if any."""
    if keys:
        first, *more = sorted(keys)
        raise StateMismatchError(
            f"{where}: key {first!r} {what}"
            + (f" (and {len(more)} more)" if more else "")
            + f"; pass strict=False to {lenient}"
        )


def validate(m: mf.Manifest, flat, where: str, strict: bool) -> list[str]:
    """Check the live state against the manifest (the module docstring says what is compared);
    return the keys to read. An entry asked for that the checkpoint lacks fails when strict."""
    both = {mf.escape_component(n) for n in flat.tree if n in m.state}
    stateless = _stateless_params(m, flat)
    live = {k for k in flat.tensors if _entry_of(k) in both} - stateless
    saved = {k for k in m.tensors if _entry_of(k) in both}
    if strict:
        _refuse_mismatch(
            where, set(flat.tree) - set(m.state), "is in the state but not in the checkpoint", "keep it as it is"
        )
        _refuse_mismatch(
            where, live - saved, "is in the state but not in the checkpoint", "keep those values as they are"
        )
        _refuse_mismatch(where, saved - live, "is in the checkpoint but not in the state", "ignore it")
        # A ``$tensor`` reference the manifest's tensor table lacks would be silently skipped.
        for name in flat.tree:
            dangling = [r for r in jsonenc.tensor_refs(m.state.get(name)) if r not in m.tensors]
            if dangling:
                raise CheckpointError(
                    f"{where}: key {name!r} refers to tensor {dangling[0]!r}, which the checkpoint does not hold"
                )
    for name, node in flat.tree.items():
        saved_node = m.state.get(name)
        if saved_node is not None and saved_node["kind"] not in _COMPATIBLE[node["kind"]]:
            raise StateMismatchError(
                f"{where}: key {name!r} was saved as a {saved_node['kind']} but the state has a {node['kind']}"
            )
    keys = [k for k in flat.tensors if k in live and k in saved]
    for k in keys:
        t, e = flat.tensors[k], m.tensors[k]
        if tuple(t.shape) != e.layout.shape:
            raise StateMismatchError(
                f"{where}: key {k!r} has shape {tuple(e.layout.shape)} in the checkpoint but "
                f"{tuple(t.shape)} in the state"
            )
        dt = zarr_dtype(t.dtype, k)
        if dt != e.layout.dtype:
            raise StateMismatchError(
                f"{where}: key {k!r} has dtype {e.layout.dtype} in the checkpoint but {dt} in the state"
            )
    return keys
