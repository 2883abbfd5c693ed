"""Restores of what real training jobs hold, in one process: parameters without optimizer
state, subsets of a training checkpoint, and errors while applying the state."""

from __future__ import annotations

import pytest
import torch

from ckptd.errors import StateMismatchError
from trainer_hooks import Checkpointer


class Experts(torch.nn.Module):
    """A router-free MoE stand-in with a frozen-by-detach layer: ``experts[1]`` is never routed
    to and ``frozen``'s output is detached, so neither gets a gradient although both keep
    ``requires_grad`` and sit in the optimizer; ``head`` is used only from step ``late`` on."""

    def __init__(self, late: int = 3):
        super().__init__()
        self.frozen = torch.nn.Linear(4, 4)
        self.experts = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
        self.head = torch.nn.Linear(4, 2)
        self.late = late

    def forward(self, x, step):
        h = self.experts[0](self.frozen(x).detach())
        out = h.sum(-1)
        if step >= self.late:
            out = out + self.head(h).sum(-1)
        return out


def make(seed: int):
    torch.manual_seed(seed)
    model = Experts()
    optim = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 0.9**s)
    return {"model": model, "optim": optim, "sched": sched}


def train(state, step):
    g = torch.Generator().manual_seed(step)
    loss = state["model"](torch.randn(3, 4, generator=g), step).pow(2).mean()
    state["optim"].zero_grad()
    loss.backward()
    state["optim"].step()
    state["sched"].step()
    return loss.item()


def stateless(state):
    return sorted(n for n, p in state["model"].named_parameters() if p not in state["optim"].state)


def test_parameters_without_optimizer_state_come_back_without_it(tmp_path):
    """No ``strict=False``: the frozen layer, the unrouted expert and the late head have no
    AdamW state at save and none after the restore, and training continues exactly, including
    the step where the head first gets a gradient."""
    state = make(0)
    for s in range(2):
        train(state, s)
    assert stateless(state) == [
        "experts.1.bias",
        "experts.1.weight",
        "frozen.bias",
        "frozen.weight",
        "head.bias",
        "head.weight",
    ]
    at_save = stateless(state)
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(1, state).result()
        expect = [train(state, s) for s in (2, 3, 4)]
        new = make(1)
        assert ck.restore(new) == 1
    assert stateless(new) == at_save
    assert [train(new, s) for s in (2, 3, 4)] == expect
    for (k, a), b in zip(state["model"].state_dict().items(), new["model"].state_dict().values(), strict=True):
        assert torch.equal(a, b), k


def test_a_subset_restores_by_default_and_a_missing_entry_names_strict(tmp_path):
    state = make(0)
    train(state, 0)
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(0, {**state, "sampler": {"epoch": 3}}).result()
        model = make(1)["model"]
        assert ck.restore({"model": model}) == 0  # for evaluation, export, fine-tuning
        for a, b in zip(state["model"].parameters(), model.parameters(), strict=True):
            assert torch.equal(a, b)
        with pytest.raises(
            StateMismatchError, match=r"key 'ema' is in the state but not in the checkpoint.*strict=False"
        ):
            ck.restore({"model": make(2)["model"], "ema": {"decay": 0.9}})
        assert ck.restore({"model": make(2)["model"], "ema": {"decay": 0.9}}, strict=False) == 0


def make_dense(seed: int):
    """A model every parameter of which is trained, after one step."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 0.9**s)
    model(torch.randn(3, 4)).pow(2).mean().backward()
    optim.step()
    sched.step()
    optim.zero_grad()
    return {"model": model, "optim": optim, "sched": sched}


def test_an_error_while_applying_names_the_key_and_leaves_the_state_untouched(tmp_path):
    """Saved with a GradScaler that was disabled (its state dict is empty), restored into an
    enabled one: torch's ``load_state_dict`` refuses. The model, optimizer and scheduler entries
    come before it in the state and were already applied: they are put back, bit for bit."""
    state = make_dense(0)
    with Checkpointer(str(tmp_path)) as ck:
        ck.save(0, {**state, "scaler": torch.amp.GradScaler("cpu", enabled=False)}).result()
        new = {**make_dense(1), "scaler": torch.amp.GradScaler("cpu", init_scale=8.0)}
        before = {k: v.clone() for k, v in new["model"].state_dict().items()}
        sched_before = new["sched"].state_dict()
        optim_before = {k: v.clone() for k, v in new["optim"].state_dict()["state"][0].items()}
        with pytest.raises(StateMismatchError, match=r"step_0000000000: key 'scaler': .*RuntimeError"):
            ck.restore(new)
    for k, v in new["model"].state_dict().items():
        assert torch.equal(v, before[k]), k
    for k, v in new["optim"].state_dict()["state"][0].items():
        assert torch.equal(v, optim_before[k]), k
    assert new["sched"].state_dict() == sched_before
    assert new["scaler"].get_scale() == 8.0

    # a fresh optimizer (no state yet: a job's first restore) has none after the failed one
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    fresh = {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=0.1)}
    with Checkpointer(str(tmp_path)) as ck, pytest.raises(StateMismatchError, match="'scaler'"):
        ck.restore({**fresh, "scaler": torch.amp.GradScaler("cpu")})
    assert len(fresh["optim"].state) == 0
