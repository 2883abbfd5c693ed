"""The default restore exchanges the read buffers with the live tensors by swapping memory
(``trainer_hooks.storage_swap``), not by copying: what that must keep true.

- torch's private ``UntypedStorage._swap_data_ptr_`` behaves as relied on (pinned here: a torch
  upgrade that changes it must fail this file, not restore wrong values);
- every alias of a live tensor (the parameter, a detached state-dict entry, a view the user
  holds) sees the restored values, and the optimizer keeps its own tensors;
- after the restore every live tensor is back in its own memory: a ``numpy()`` view taken
  before it reads the restored values (the buffers' memory is freed: were it kept, such views
  would dangle);
- memory other processes share, or a view into a larger storage, is copied into, never swapped;
- a restore that fails (a corrupt or missing chunk file, on disk) leaves every live tensor
  bitwise as it was, in the same memory.
"""

from __future__ import annotations

import os

import pytest
import torch

from ckptd.errors import CheckpointError, CorruptChunkError
from trainer_hooks import Checkpointer
from trainer_hooks.storage_swap import can_swap_memory, exchange, settle


def bits(t: torch.Tensor) -> bytes:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def test_torch_swap_data_ptr_exchanges_the_memory_of_two_storages():
    a, b = torch.arange(6.0), torch.full((6,), 7.0)
    pa, pb = a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()
    a.untyped_storage()._swap_data_ptr_(b.untyped_storage())
    assert a.untyped_storage().data_ptr() == pb and b.untyped_storage().data_ptr() == pa
    assert a.tolist() == [7.0] * 6 and b.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def test_exchange_swaps_memory_and_every_alias_follows():
    p = torch.nn.Parameter(torch.randn(4, 3))
    alias, view = p.detach(), p.view(-1)  # a state-dict entry, a view the user keeps
    old, fresh = bits(p), torch.randn(4, 3)
    new = bits(fresh)
    ptr, version = p.data_ptr(), p._version
    assert can_swap_memory(alias, fresh)
    exchange(alias, fresh, True)
    assert bits(p) == new and bits(view) == new and bits(fresh) == old
    assert p.data_ptr() != ptr and view.data_ptr() == p.data_ptr()  # no copy: the memory moved
    assert p._version > version  # autograd sees the write, as with a copy
    exchange(alias, fresh, True)  # an involution: the undo of a failed apply
    assert bits(p) == old and p.data_ptr() == ptr
    exchange(alias, fresh, True)
    settle([(alias, fresh, True)])  # success: p back in its own memory, holding the new bytes
    assert p.data_ptr() == ptr and bits(p) == new and bits(view) == new


def test_settle_leaves_tensors_sharing_a_storage_as_sequential_copies_would():
    live, a, b = torch.zeros(4), torch.ones(4), torch.full((4,), 2.0)
    ptr = live.data_ptr()
    exchange(live, a, True)
    exchange(live, b, True)
    assert live.tolist() == [2.0] * 4
    settle([(live, a, True), (live, b, True)])
    assert live.data_ptr() == ptr and live.tolist() == [2.0] * 4


def test_shared_memory_and_partial_views_are_copied_into_not_swapped():
    shared = torch.randn(8).share_memory_()
    part = torch.randn(16)[4:12]  # a view into a larger storage
    pinned_or_odd = [shared, part]
    for live in pinned_or_odd:
        fresh = torch.randn(8)
        ptr, want, old = live.data_ptr(), bits(fresh), bits(live)
        assert not can_swap_memory(live, fresh)
        exchange(live, fresh, False)
        assert live.data_ptr() == ptr and bits(live) == want and bits(fresh) == old
    assert shared.is_shared()


def make(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 64)).pow(2).mean().backward()
    opt.step()
    with torch.no_grad():
        model[0].weight[0, :3] = torch.tensor([-0.0, float("nan"), float("inf")])  # bits, not values
    return {"model": model, "optim": opt}


def live_tensors(state) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v for k, v in state["model"].state_dict(keep_vars=True).items()}
    params = [p for g in state["optim"].param_groups for p in g["params"]]
    for i, p in enumerate(params):
        out.update({f"optim/{i}/{k}": v for k, v in state["optim"].state.get(p, {}).items()})
    return out


def test_default_restore_keeps_every_alias_and_raw_view_of_the_live_tensors(tmp_path):
    saved, other = make(0), make(1)
    with Checkpointer(str(tmp_path / "job")) as ck:
        ck.save(1, saved).result()
        weight = other["model"][0].weight
        view, arr = weight.view(-1), weight.detach().numpy()  # a torch view, a raw numpy view
        exp_avg = other["optim"].state[weight]["exp_avg"]
        other["model"][2].bias.data.share_memory_()  # another process may map it
        ptrs = {k: v.data_ptr() for k, v in live_tensors(other).items()}
        assert ck.restore(other) == 1
        for _ in range(3):  # reuse freed memory: a view left dangling would read other bytes
            torch.randn(64, 256).add_(1)
    want, got = live_tensors(saved), live_tensors(other)
    assert all(bits(want[k]) == bits(got[k]) for k in want)
    assert {k: v.data_ptr() for k, v in got.items()} == ptrs  # every tensor in its own memory
    assert bits(view) == bits(saved["model"][0].weight)
    assert arr.tobytes() == bits(saved["model"][0].weight)
    assert other["optim"].state[weight]["exp_avg"] is exp_avg  # the optimizer keeps its tensors
    assert other["model"][2].bias.is_shared()


def test_default_restore_of_tied_weights_keeps_them_tied(tmp_path):
    def tied(seed):
        torch.manual_seed(seed)
        emb, head = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32, bias=False)
        head.weight = emb.weight
        return {"model": torch.nn.Sequential(emb, head)}

    saved, other = tied(0), tied(1)
    with Checkpointer(str(tmp_path / "job")) as ck:
        ck.save(1, saved).result()
        assert ck.restore(other) == 1
    m = other["model"]
    assert m[0].weight is m[1].weight and bits(m[0].weight) == bits(saved["model"][0].weight)


def _chunk_files(root: str, array: str) -> list[str]:
    folder = os.path.join(root, "step_0000000001", "arrays", *array.split("/"), "c")
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs)


def flip_a_data_bit(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize(
    ("fault", "error"),
    [("corrupt", CorruptChunkError), ("missing", CheckpointError)],
)
def test_a_failed_read_leaves_every_live_tensor_bitwise_unchanged_in_its_memory(tmp_path, fault, error):
    """The fault is real: a chunk file of the optimizer state (read after the model's tensors)
    is corrupted or deleted on disk. Every tensor read before it had landed in a fresh buffer;
    none of them may reach the state."""
    root = str(tmp_path / "job")
    with Checkpointer(root) as ck:
        ck.save(1, make(0)).result()
    files = _chunk_files(root, "optim/state/2.weight/exp_avg_sq")
    assert files
    if fault == "corrupt":
        flip_a_data_bit(files[-1])
    else:
        os.remove(files[-1])
    other = make(1)
    before = {k: (bits(v), v.data_ptr()) for k, v in live_tensors(other).items()}
    with Checkpointer(root) as ck, pytest.raises(error, match="exp_avg_sq"):
        ck.restore(other)
    after = {k: (bits(v), v.data_ptr()) for k, v in live_tensors(other).items()}
    assert after == before
