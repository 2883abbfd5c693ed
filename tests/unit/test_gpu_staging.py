"""The GPU snapshot path's logic, on CPU: no CUDA here or in CI, so torch.cuda's streams and
events are stood in for by recorders, and GPU tensors by CPU tensors that say ``is_cuda``.

What is checked is ckptd's own sequencing, the part a GPU run could get wrong silently:
- every shard of a GPU tensor is staged into a pinned buffer, CPU tensors' are not;
- each copy is issued on the side stream, after that stream waited for the training stream, and
  records its source on the side stream (so the caching allocator keeps it alive);
- one event is recorded on the side stream after the last copy, the training stream waits on it
  (parameters cannot be overwritten before they are copied) and the job carries it;
- the writer synchronizes on that event before it reads a byte;
- a GPU scalar is copied, not inlined (reading its value would stall on the device);
- the staged bytes equal the tensors'.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ckptd import manifest as mf
from ckptd import persist
from storage_backends import open_store
from trainer_hooks.flatten import as_numpy, flatten
from trainer_hooks.snapshot import Planner, Stager, take

log: list[tuple] = []


class FakeCuda(torch.Tensor):
    """A CPU tensor that says it lives on a GPU."""

    @property
    def is_cuda(self) -> bool:
        return True

    def record_stream(self, stream) -> None:
        log.append(("record_stream", stream.name))


class FakeStream:
    def __init__(self, name: str = "side"):
        self.name = name

    def wait_stream(self, other) -> None:
        log.append(("wait_stream", self.name, other.name))

    def wait_event(self, ev) -> None:
        log.append(("wait_event", self.name, ev.name))


class FakeEvent:
    count = 0

    def __init__(self):
        FakeEvent.count += 1
        self.name = f"event{FakeEvent.count}"
        self.synchronized = False

    def record(self, stream) -> None:
        log.append(("record", self.name, stream.name))

    def synchronize(self) -> None:
        log.append(("synchronize", self.name))
        self.synchronized = True


TRAINING = FakeStream("training")


class PinRecordingStager(Stager):
    pins: list[bool] = []

    @staticmethod
    def _alloc(shape, dtype, pin):
        PinRecordingStager.pins.append(pin)
        return torch.empty(shape, dtype=dtype)  # no pinned allocator on a CPU build


@pytest.fixture
def fake_cuda(monkeypatch):
    log.clear()
    PinRecordingStager.pins = []
    current = {"stream": TRAINING}

    @contextlib.contextmanager
    def stream_ctx(s):
        prev, current["stream"] = current["stream"], s
        log.append(("enter", s.name))
        try:
            yield
        finally:
            current["stream"] = prev
            log.append(("exit", s.name))

    monkeypatch.setattr(torch.cuda, "Stream", lambda: FakeStream("side"))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current["stream"])
    monkeypatch.setattr(torch.cuda, "stream", stream_ctx)
    real_copy = torch.Tensor.copy_
    depth = [0]

    def copy_(self, src, non_blocking=False):
        if not depth[0]:  # the subclass's dispatch comes back here once more: log the call only
            log.append(("copy", current["stream"].name, non_blocking, tuple(src.shape)))
        depth[0] += 1
        try:
            return real_copy(self, src)
        finally:
            depth[0] -= 1

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    return log


def gpu(t: torch.Tensor) -> torch.Tensor:
    return torch.Tensor._make_subclass(FakeCuda, t)


def test_gpu_tensors_stage_pinned_on_a_side_stream_and_the_writer_waits(fake_cuda, tmp_path):
    torch.manual_seed(0)
    w, b, step_count = torch.randn(64, 32), torch.randn(32), torch.tensor(7.0)
    cpu_t = torch.arange(10, dtype=torch.float32)
    state = {"w": gpu(w), "b": gpu(b), "step": gpu(step_count), "cpu": cpu_t}
    stager = PinRecordingStager()
    flat = flatten(state)
    job, entries = take(flat, 1, "a1", 0, 1, stager, Planner())
    job.metadata += persist.manifest_objects(mf.Manifest(1, 1, entries, flat.tree, "a1"))

    copies = [e for e in log if e[0] == "copy"]
    # w, b and the GPU scalar (copied, not inlined), async, on the side stream; the CPU tensor
    # is copied by hostcopy (checked below), not by copy_ on any stream
    assert len(copies) == 3 and (10,) not in [c[3] for c in copies]
    assert all(c[1] == "side" and c[2] is True for c in copies)
    assert sorted(PinRecordingStager.pins) == [False, True, True, True]
    assert entries["step"].value is None  # a GPU scalar keeps its chunk
    for i, e in enumerate(log):  # every side-stream copy waits for the training stream first
        if e[:2] == ("copy", "side"):
            assert ("wait_stream", "side", "training") in log[:i]
    assert log.count(("record_stream", "side")) == 3
    # one event after the last copy, on the side stream; the training stream waits on it
    last_copy = max(i for i, e in enumerate(log) if e[0] == "copy")
    records = [(i, e) for i, e in enumerate(log) if e[0] == "record"]
    assert len(records) == 1 and records[0][0] > last_copy and records[0][1][2] == "side"
    ev = records[0][1][1]
    assert ("wait_event", "training", ev) in log[records[0][0] :]
    assert isinstance(job.ready, FakeEvent) and job.ready.name == ev and not job.ready.synchronized
    staged = {sw.key: sw.buffer for sw in job.shards}
    assert torch.equal(staged["w"], w) and torch.equal(staged["b"], b) and torch.equal(staged["cpu"], cpu_t)

    n = len(log)
    store = open_store(str(tmp_path / "job"))
    with ThreadPoolExecutor(2) as pool:
        assert persist.persist(store, job, pool, wait=False, to_numpy=as_numpy).committed_here
    assert job.ready.synchronized and log[n] == ("synchronize", ev)  # before any read of the buffers


def test_cpu_only_state_records_no_event(fake_cuda):
    state = {"w": torch.randn(8, 4), "step": torch.tensor(3)}
    job, entries = take(flatten(state), 1, "a1", 0, 1, PinRecordingStager(), Planner())
    assert job.ready is None and PinRecordingStager.pins == [False]  # the scalar is inlined
    assert entries["step"].value == 3
    assert not [e for e in log if e[0] in ("record", "wait_stream", "wait_event")]
