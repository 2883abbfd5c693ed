"""``ckptd show URI [--step N]``: the tensors of one committed checkpoint and how they are stored."""

from __future__ import annotations

import argparse

from ckptd import catalog
from ckptd import manifest as mf
from ckptd.cli.common import (
    add_json,
    add_step,
    add_uri,
    human_bytes,
    iso_time,
    job_root,
    print_json,
    print_table,
    printable,
    shape_str,
)

__all__ = ["HELP", "add_arguments", "run", "state_summary"]

HELP = "show every tensor of a checkpoint: key, global shape, dtype, chunking, bytes, array path"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_uri(p)
    add_step(p)
    add_json(p)


def state_summary(m: mf.Manifest) -> dict[str, str]:
    """Top-level state names and their kinds (module, optimizer, dict, ...)."""
    out = {}
    for name, node in m.state.items():
        kind = node.get("kind") if isinstance(node, dict) else None
        out[name] = kind if isinstance(kind, str) else type(node).__name__
    return out


def run(args: argparse.Namespace) -> int:
    with job_root(args.uri) as store:
        m = catalog.load_manifest(store, args.step)
        where = catalog.where(store, m.step)
    tensors = sorted(m.tensors.values(), key=lambda t: t.key)
    if args.json:
        print_json(
            {
                "step": m.step,
                "checkpoint_path": mf.step_dir(m.step),
                "world_size": m.world_size,
                "created": m.created,
                "bytes": m.nbytes,
                "tensors": [t.to_json() for t in tensors],
                "state": state_summary(m),
            }
        )
        return 0
    print(
        f"{where}: step {m.step}, saved at world size {m.world_size}, {iso_time(m.created)}, "
        f"{len(tensors)} tensors, {human_bytes(m.nbytes)}"
    )
    kinds = ", ".join(f"{k} ({v})" for k, v in state_summary(m).items())
    print(f"state: {printable(kinds or '-')}")
    headers = ["KEY", "SHAPE", "DTYPE", "SHARD", "CHUNK", "BYTES", "PATH"]
    with_placements = any(t.placements for t in tensors)
    if with_placements:
        headers.append("PLACEMENTS")
    rows = [
        [t.key, shape_str(t.layout.shape), t.layout.dtype, shape_str(t.layout.shard_shape)]
        + [shape_str(t.layout.chunk_shape), human_bytes(t.layout.nbytes), t.path]
        + ([t.placements or "-"] if with_placements else [])
        for t in tensors
    ]
    if rows:
        print()
        print_table(headers, rows)
    return 0
