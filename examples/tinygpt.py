"""A tiny GPT and the synthetic corpus it learns, shared by ``train_elastic.py`` and the demo.

Nothing is downloaded. The corpus is English-like text generated from a small grammar with a
fixed seed, so every rank (and every run) builds the same samples without communicating, and
the structure is easy enough that the loss falls visibly within a few hundred steps on a CPU.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

_SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the robot", "a small bird", "the teacher", "our team"]
_VERBS = ["sees", "likes", "builds", "paints", "follows", "finds", "carries", "reads"]
_OBJECTS = ["the red ball", "a long book", "the tall tree", "a new house", "the river", "two apples", "the map"]
_ENDINGS = ["today", "at night", "in the park", "again", "slowly", "with care"]


def corpus(chars: int, seed: int = 1234) -> str:
    """``chars`` characters of sentences from a small grammar; the same for the same seed."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < chars:
        words = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)]
        if rng.random() < 0.5:
            words.append(rng.choice(_ENDINGS))
        sentence = " ".join(words) + ". "
        parts.append(sentence)
        size += len(sentence)
    return "".join(parts)[:chars]


class CharDataset(torch.utils.data.Dataset):
    """``samples`` non-overlapping windows of ``seq_len + 1`` characters of the corpus.

    Item ``i`` is ``(i, x, y)``: the sample index (so training can log exactly what it saw), the
    input characters and the next characters to predict."""

    def __init__(self, samples: int, seq_len: int, seed: int = 1234):
        text = corpus(samples * (seq_len + 1), seed)
        self.chars = sorted(set(text))
        lookup = {c: i for i, c in enumerate(self.chars)}
        ids = torch.tensor([lookup[c] for c in text], dtype=torch.long)
        self.data = ids.view(samples, seq_len + 1)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, i: int):
        row = self.data[i]
        return i, row[:-1], row[1:]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    seq_len: int = 32
    dim: int = 64
    layers: int = 2
    heads: int = 4


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.out = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """Token and position embeddings, ``layers`` pre-norm transformer blocks, a final norm and an
    untied output head."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02 if not name.endswith("out.weight") else 0.02 / math.sqrt(2 * cfg.layers))
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def shard(model: TinyGPT, world_size: int) -> TinyGPT:
    """FSDP2 over all ranks on a 1-D CPU mesh: each block is its own unit (all-gathered just
    before use, freed after), and the root holds the embeddings, final norm and head."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
