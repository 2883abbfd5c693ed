"""The toy model and dataset of the Hugging Face tests (tests/e2e/test_callbacks.py and the ranks
of tests/distributed/test_hf_elastic.py): samples carry their index, and the model records the
indices of every forward pass, so a test can tell which samples each optimizer step saw."""

from __future__ import annotations

import torch


class IndexedData(torch.utils.data.Dataset):
    """``n`` samples ``{"x", "labels", "idx"}``, the same for every ``n`` prefix (seeded)."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(1)
        self.n = n
        self.x, self.y = torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i], "idx": torch.tensor(i)}


class IndexedNet(torch.nn.Module):
    """A linear model (initialised from ``seed``) that appends each batch's ``idx`` to ``seen``."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc = torch.nn.Linear(4, 1)
        self.seen: list[int] = []

    def forward(self, x, labels=None, idx=None):
        self.seen += idx.tolist()
        out = self.fc(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}
