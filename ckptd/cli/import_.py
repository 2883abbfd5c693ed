"""``ckptd import SRC --format dcp|torch|safetensors|deepspeed-universal URI --step N [--as KEY]
[--trust-pickle]``: write a checkpoint made by another tool into a job root as a committed ckptd
checkpoint. DCP needs ``--trust-pickle``: its ``.metadata`` is a pickle (see ``ckptd.interop``)."""

from __future__ import annotations

import argparse

from ckptd.cli.common import Progress, add_uri, human_bytes, job_root, note, step_arg
from ckptd.interop import IMPORT_FORMATS, import_checkpoint

__all__ = ["HELP", "add_arguments", "run"]

HELP = "import a DCP folder, torch.save file, safetensors or DeepSpeed universal checkpoint as a committed checkpoint"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", metavar="SRC", help="the checkpoint to import (a file or folder)")
    p.add_argument("--format", required=True, choices=list(IMPORT_FORMATS), help="the format of SRC")
    add_uri(p)
    p.add_argument("--step", type=step_arg, required=True, help="the step to write (must not be committed yet)")
    p.add_argument(
        "--as",
        dest="as_key",
        default="model",
        metavar="KEY",
        help="state key for a flat state dict (torch, safetensors) or for DCP top-level tensors (default: model)",
    )
    p.add_argument(
        "--max-tensors",
        type=int,
        default=None,
        metavar="N",
        help="refuse a source of more than N tensors (default 250000; each tensor is an array to write)",
    )
    p.add_argument(
        "--trust-pickle",
        action="store_true",
        help="allow unpickling DCP's .metadata (a pickle can run code: only for a SRC you would torch.load)",
    )


def run(args: argparse.Namespace) -> int:
    with job_root(args.uri) as store, Progress(f"importing {args.format}") as progress:
        res = import_checkpoint(
            args.src,
            args.format,
            store,
            args.step,
            args.as_key,
            progress,
            trust_pickle=args.trust_pickle,
            max_tensors=args.max_tensors,
        )
    for text in res.notes:
        note(text)
    kinds = ", ".join(f"{name} ({kind})" for name, kind in res.kinds.items()) or "-"
    print(f"{res.where}: imported {res.tensors} tensors ({human_bytes(res.bytes)}) from {args.src}; state: {kinds}")
    return 0
