"""The elastic sampler's arithmetic: how one epoch's rest is dealt to M ranks, where the
global position stands after each rank consumed k indices, and where a saved sampler state
resumes at another world size.

Pure (no torch): ``trainer_hooks.sampler.ElasticSampler`` deals with these functions, and
``ckptd reshard`` uses the same ones to print where each rank of the new job resumes, so the
two can never disagree. The dealing (``ElasticSampler``'s docstring has the whole contract):
from global position ``P`` of the epoch's order, rank ``r`` of ``M`` yields ``order[P + r]``,
``order[P + r + M]``, ...; without ``drop_last`` the lower ranks get one more of an uneven rest,
with it every rank gets ``floor(rest / M)`` and the tail is dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = [
    "STATE_KEYS",
    "STATE_VERSION",
    "SamplerResume",
    "find_samplers",
    "position_after",
    "remap_data_position",
    "sampler_resume",
    "share",
]

STATE_VERSION = 1
# The keys of ``ElasticSampler.state_dict()``, in its order.
STATE_KEYS = ("version", "epoch", "position", "seed", "shuffle", "drop_last", "dataset_len")


def share(dataset_len: int, start: int, rank: int, world_size: int, drop_last: bool) -> int:
    """How many indices of ``order[start:]`` rank ``rank`` of ``world_size`` gets."""
    rest = dataset_len - start
    if drop_last:
        return rest // world_size
    return max(0, (rest - rank + world_size - 1) // world_size)


def position_after(dataset_len: int, start: int, consumed: int, world_size: int, drop_last: bool) -> int:
    """The global position once every rank has consumed ``consumed`` indices of a pass that
    began at ``start`` (capped at ``dataset_len``; with ``drop_last``, ``dataset_len`` once every
    rank has had its equal share: the tail is dropped for this epoch)."""
    rest = dataset_len - start
    if drop_last and consumed >= rest // world_size:
        return dataset_len
    return min(start + consumed * world_size, dataset_len)


@dataclass(frozen=True, slots=True)
class SamplerResume:
    """Where one saved ``ElasticSampler`` state resumes at M ranks. ``ranks[r]`` is
    ``(global position of rank r's first index, indices rank r has left this epoch)``."""

    key: str
    epoch: int
    position: int
    dataset_len: int
    shuffle: bool
    drop_last: bool
    ranks: tuple[tuple[int, int], ...]

    @property
    def finished(self) -> bool:
        return self.position >= self.dataset_len

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "ranks"} | {
            "epoch_finished": self.finished,
            "ranks": [{"rank": r, "resumes_at": p, "samples_left": n} for r, (p, n) in enumerate(self.ranks)],
        }


def sampler_resume(key: str, state: Mapping[str, Any], world_size: int) -> SamplerResume:
    """Where ``state`` resumes at ``world_size`` by the dealing above, with its saved
    ``drop_last`` (a sampler built with another keeps its own)."""
    n, p = int(state["dataset_len"]), min(int(state["position"]), int(state["dataset_len"]))
    shares = [share(n, p, r, world_size, bool(state["drop_last"])) for r in range(world_size)]
    ranks = tuple((p + r if left else n, left) for r, left in enumerate(shares))
    return SamplerResume(key, int(state["epoch"]), p, n, bool(state["shuffle"]), bool(state["drop_last"]), ranks)


def find_samplers(tree: Mapping[str, Any]) -> list[tuple[str, dict]]:
    """ElasticSampler states in a manifest's state tree: ``(path, state)`` for every dict that
    has the sampler's keys with int/bool values. Usually a top-level entry of kind
    ``stateful``; nested plain dicts are found too."""
    out: list[tuple[str, dict]] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            if set(node) >= set(STATE_KEYS) and all(isinstance(node[k], int) for k in STATE_KEYS):
                out.append((path, dict(node)))
                return
            for k, v in node.items():
                walk(v, f"{path}/{k}" if path else str(k))
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}")

    for name, entry in tree.items():
        if isinstance(entry, dict) and entry.get("kind") in ("stateful", "dict", "value"):
            walk(entry.get("data"), name)
    return out


def remap_data_position(tree: Mapping[str, Any], world_size: int) -> list[SamplerResume]:
    return [sampler_resume(path, state, world_size) for path, state in find_samplers(tree)]
