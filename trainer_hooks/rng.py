"""RNG state of one rank: python, numpy, torch CPU and (where present) CUDA.

Saved per rank (in the rank's done record). At the same world size each rank gets its own back;
at another world size, ranks that existed get theirs, new ranks are reseeded deterministically
from saved rank 0's state and their rank, so a resumed job is reproducible.
"""

from __future__ import annotations

import random
import zlib

import numpy as np
import torch

__all__ = ["capture", "reseed", "restore"]


def capture() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": bytes(torch.get_rng_state().numpy().tobytes()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [bytes(s.numpy().tobytes()) for s in torch.cuda.get_rng_state_all()]
    return state


def restore(state: dict) -> None:
    random.setstate(_as_tuple(state["python"]))
    np.random.set_state(_as_tuple(state["numpy"]))
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(torch.frombuffer(bytearray(s), dtype=torch.uint8), i)


def reseed(base: dict, rank: int) -> int:
    """Seed every generator from saved state ``base`` and ``rank``; returns the seed."""
    seed = zlib.crc32(bytes(base["torch"]) + rank.to_bytes(4, "little"))
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return seed


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, list | tuple) else x
