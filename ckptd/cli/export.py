"""``ckptd export URI [--step N] --format torch|safetensors|dcp OUT [--as KEY] [--max-shard-size S]``:
write a committed checkpoint in another tool's format, one tensor at a time."""

from __future__ import annotations

import argparse

from ckptd.cli.common import Progress, UsageError, add_step, add_uri, job_root, note
from ckptd.interop import EXPORT_FORMATS, export_checkpoint

__all__ = ["HELP", "add_arguments", "parse_size", "run"]

HELP = "export a checkpoint as a torch.save file, safetensors (optionally sharded) or a DCP folder"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_uri(p)
    add_step(p)
    p.add_argument("--format", required=True, choices=list(EXPORT_FORMATS), help="the format to write")
    p.add_argument("out", metavar="OUT", help="file or folder to write (must not exist, or be an empty folder)")
    p.add_argument(
        "--as",
        dest="as_key",
        default=None,
        metavar="KEY",
        help="torch/safetensors: the state entry to write as a flat state dict (default: model); "
        "dcp writes every entry",
    )
    p.add_argument(
        "--max-shard-size",
        default=None,
        metavar="SIZE",
        help="safetensors: split into shards of at most SIZE (5GB, 500MiB) plus model.safetensors.index.json",
    )


def parse_size(text: str) -> int:
    """``5GB`` (10^9 bytes, as Hugging Face counts), ``500MiB`` (2^20), ``1000000`` (bytes)."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    units |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    t = text.strip().upper()
    num = t.rstrip("KMGTIB")
    unit = t[len(num) :]
    try:
        n = float(num)
    except ValueError:
        n = -1.0
    if unit not in units or not n > 0:
        raise ValueError(f"invalid size {text!r}: expected a positive number and a unit, e.g. 5GB or 500MiB")
    return int(n * units[unit])


def run(args: argparse.Namespace) -> int:
    if args.format == "dcp" and args.as_key is not None:
        raise UsageError("--as applies to torch and safetensors exports; dcp writes every state entry")
    max_shard = None
    if args.max_shard_size is not None:
        if args.format != "safetensors":
            raise UsageError("--max-shard-size applies to safetensors exports only")
        try:
            max_shard = parse_size(args.max_shard_size)
        except ValueError as e:
            raise UsageError(str(e)) from None
    with job_root(args.uri) as store, Progress(f"exporting {args.format}") as progress:
        res = export_checkpoint(store, args.step, args.format, args.out, args.as_key or "model", max_shard, progress)
    if res.skipped:
        note(f"left out {res.skipped} non-tensor values, which {args.format} files do not hold")
    files = len(res.files)
    print(f"{args.out}: wrote {res.tensors} tensors in {files} file{'s' if files != 1 else ''}")
    return 0
