"""The synthetic training state every system saves: a GPT-like stack of fp32 parameters plus
AdamW's ``exp_avg``/``exp_avg_sq`` (so the state is ~3x the parameters), sized to a byte target.

The same builder serves the single-process rows (plain ``nn.Module``) and the resharding rows
(FSDP2 ``fully_shard`` over a CPU/gloo mesh, built on the meta device so no rank ever holds the
whole model).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass(frozen=True)
class Dims:
    vocab: int
    dim: int
    layers: int

    @property
    def params(self) -> int:
        d = self.dim
        return 2 * self.vocab * d + 2 * d + self.layers * (12 * d * d + 13 * d)

    @property
    def state_bytes(self) -> int:
        """fp32 parameters + exp_avg + exp_avg_sq (the step counters are negligible)."""
        return 3 * 4 * self.params


def dims_for(state_bytes: int) -> Dims:
    """Model dimensions whose state (3 x fp32 parameters) is close to ``state_bytes``."""
    params = max(1, state_bytes // 12)
    dim = 64
    for d in (128, 256, 512, 1024, 2048, 4096):
        if 2 * 16 * d * d + 12 * d * d <= params:  # embedding + head + at least one layer
            dim = d
    vocab = 16 * dim
    per_layer = 12 * dim * dim + 13 * dim
    layers = max(1, round((params - 2 * vocab * dim - 2 * dim) / per_layer))
    return Dims(vocab, dim, layers)


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):  # pragma: no cover - never trained here
        h = self.ln1(x)
        x = x + self.proj(self.qkv(h)[..., : x.shape[-1]])
        return x + self.fc2(torch.relu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, dims: Dims):
        super().__init__()
        self.emb = nn.Embedding(dims.vocab, dims.dim)
        self.blocks = nn.ModuleList(Block(dims.dim) for _ in range(dims.layers))
        self.ln_f = nn.LayerNorm(dims.dim)
        self.head = nn.Linear(dims.dim, dims.vocab, bias=False)

    def forward(self, idx):  # pragma: no cover - never trained here
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _fill_optimizer(model: nn.Module, optim: torch.optim.Optimizer, gen: torch.Generator) -> None:
    """AdamW state as its first step leaves it (step, exp_avg, exp_avg_sq), with random values,
    without running the step (cheaper and identical in structure)."""
    for p in model.parameters():
        ea = torch.empty_like(p)
        eas = torch.empty_like(p)
        _local(ea).normal_(generator=gen)
        _local(eas).uniform_(generator=gen)
        optim.state[p] = {"step": torch.tensor(1.0), "exp_avg": ea, "exp_avg_sq": eas}


def build_local(state_bytes: int, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, Dims]:
    dims = dims_for(state_bytes)
    with torch.device("meta"):
        model = GPT(dims)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(generator=gen)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    _fill_optimizer(model, optim, gen)
    return model, optim, dims


def build_fsdp(state_bytes: int, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, Dims]:
    """FSDP2 over every rank of the default process group (CPU, gloo). Values differ per rank
    and per seed; their layout is FSDP's dim-0 ``torch.chunk`` split."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dims = dims_for(state_bytes)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with torch.device("meta"):
        model = GPT(dims)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
    with torch.no_grad():
        for p in model.parameters():
            _local(p).normal_(generator=gen)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    _fill_optimizer(model, optim, gen)
    return model, optim, dims


def all_tensors(model: nn.Module, optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the state (local shards for DTensors), parameters first."""
    out = [_local(p.detach()) for p in model.parameters()]
    for p in model.parameters():
        s = optim.state.get(p, {})
        out += [_local(s[k]) for k in ("exp_avg", "exp_avg_sq", "step") if k in s]
    return out


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def dcp_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    """What a DCP or torch.save user saves: FQN-keyed model and optimizer state dicts."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optim)
    return {"model": msd, "optim": osd}


def dcp_apply(model: nn.Module, optim: torch.optim.Optimizer, sd: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def sentinel(model: nn.Module) -> torch.Tensor:
    """A small parameter whose value a restore must bring back (checked after every restore)."""
    return model.ln_f.weight


def describe(dims: Dims) -> str:
    return (
        f"GPT-like: vocab {dims.vocab}, dim {dims.dim}, {dims.layers} layers, "
        f"{dims.params / 1e6:.1f} M fp32 parameters (x3 with AdamW state)"
    )
