"""``trainer_hooks.hostcopy.copy_all``: the snapshot's and the restore's bulk copy must equal
``dst.copy_(src)`` bit for bit for every dtype a state holds (numpy lacks bfloat16 and float8),
for strided sources and destinations (object images are chunked views), across piece
boundaries, with and without a pool; and it must not return before every piece is copied."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from trainer_hooks import hostcopy
from trainer_hooks.hostcopy import copy_all

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8, torch.uint8,
          torch.bool, torch.complex64, torch.float8_e4m3fn]  # fmt: skip


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def sample(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if not dtype.is_floating_point and not dtype.is_complex:
        return torch.randint(-100 if dtype.is_signed else 0, 100, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g, dtype=torch.float32 if dtype != torch.complex64 else dtype).to(dtype)


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(4) as p:
        yield p


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_bitwise_contiguous_and_strided(dtype, pool):
    src = sample((37, 19), dtype, 1)
    dst = torch.zeros_like(src)
    big = sample((64, 40), dtype, 2)
    strided_src = big[3:40:1, 5:24]  # rows of a larger tensor: not contiguous
    strided_dst = torch.zeros(64, 40, dtype=dtype)[10:47, 2:21]
    scalar_src, scalar_dst = sample((), dtype, 3), torch.zeros((), dtype=dtype)
    copy_all([(dst, src), (strided_dst, strided_src), (scalar_dst, scalar_src)], pool)
    assert bits(dst) == bits(src)
    assert bits(strided_dst) == bits(strided_src)
    assert bits(scalar_dst) == bits(scalar_src)


@pytest.mark.parametrize("with_pool", [True, False])
def test_pieces_cover_every_byte_across_boundaries(monkeypatch, pool, with_pool):
    monkeypatch.setattr(hostcopy, "PIECE_BYTES", 4096)  # many pieces from small tensors
    pairs = []
    for i, rows in enumerate([1, 7, 333, 1024, 1025]):
        src = sample((rows, 13), torch.float32, i)
        pairs.append((torch.full_like(src, float("nan")), src))
    view = torch.zeros(50, 3, 130)  # a chunked image view: (chunks, rows, cols) with a gap per chunk
    flat = torch.zeros(50 * (3 * 130 + 1))
    chunked = flat.view(50, 3 * 130 + 1)[:, : 3 * 130].view(50, 3, 130)
    pairs.append((chunked, sample(view.shape, torch.float32, 9)))
    copy_all(pairs, pool if with_pool else None)
    for dst, src in pairs:
        assert bits(dst) == bits(src)
    assert torch.all(flat.view(50, -1)[:, -1] == 0)  # the gaps (a chunk's crc) are not written


def test_conjugate_views_fall_back_to_torch(pool):
    src = sample((8,), torch.complex64, 4).conj()  # a lazy conjugate: no numpy view of it
    dst = torch.zeros(8, dtype=torch.complex64)
    copy_all([(dst, src)], pool)
    assert torch.equal(dst, src.resolve_conj())


def _faults_writing(t: torch.Tensor) -> int:
    """Minor page faults this thread takes writing every byte of ``t`` (numpy: one thread)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    t.view(torch.uint8).numpy().fill(7)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def test_populate_faults_pages_in_without_changing_a_byte():
    pages = (64 << 20) // 4096
    fresh = torch.empty(64 << 20, dtype=torch.uint8)  # a fresh mapping: no page faulted in yet
    assert _faults_writing(fresh) > pages // 2  # the kernel faults the pages in on first write
    written = torch.empty(64 << 20, dtype=torch.uint8)
    head = sample((1 << 20,), torch.uint8, 5)
    written[: 1 << 20] = head  # the first MiB holds data: populating must keep it
    if not hostcopy.populate([written]):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert bits(written[: 1 << 20]) == bits(head)
    assert _faults_writing(written) < pages // 100


def test_prefaulting_stops_and_joins_its_thread_when_the_body_ends():
    import threading

    bufs = [torch.empty(16 << 20, dtype=torch.uint8) for _ in range(8)]
    with hostcopy.prefaulting(bufs):
        bufs[0].view(torch.uint8).numpy().fill(1)  # the body writes while the thread populates
    assert torch.all(bufs[0] == 1)
    assert not any(t.name == "ckptd-prefault" for t in threading.enumerate())
    with pytest.raises(ZeroDivisionError), hostcopy.prefaulting(bufs):
        _ = 1 / 0  # an error in the body (a failed read): the thread is still stopped and joined
    assert not any(t.name == "ckptd-prefault" for t in threading.enumerate())
