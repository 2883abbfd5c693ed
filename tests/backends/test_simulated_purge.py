"""The simulated store's ``purge`` keeps ``delete_workers`` DeleteObjects in flight, as
``S3Store.purge`` does (issue 31), so the simulator's retention figures are the real store's.
Times are the virtual clock's (deterministic), never the wall's."""

from __future__ import annotations

from tests.doubles.simulated import SimulatedStore, VirtualClock


def _purge(workers: int) -> tuple[tuple[int, int], float, int, list[str]]:
    clock = VirtualClock()
    store = SimulatedStore(clock, latency=0.02, delete_workers=workers)
    for i in range(3500):
        store.inner.put(f"step_1/c/{i:05d}", b"x")
    store.reindex()
    got: list = []

    def body() -> None:
        listed = clock.time()
        for _ in store._pages("step_1/"):  # what purge's own listing costs
            pass
        start = clock.time()
        got.append(store.purge("step_1/"))
        got.append((clock.time() - start) - (start - listed))

    clock.spawn(body)
    clock.run(timeout=60)
    return got[0], got[1], store.stats.requests["DELETE"], [i.key for i in store.list("step_1/")]


def test_purge_overlaps_its_batches():
    out1, deletes1, sent1, left1 = _purge(1)
    out4, deletes4, sent4, left4 = _purge(4)
    assert out1 == out4 == (3500, 3500) and left1 == left4 == []
    assert sent1 == sent4 == 4  # 3500 keys: 4 DeleteObjects either way
    # one at a time the 4 DeleteObjects take 4 round trips; 4 in flight take one
    assert abs(deletes1 - 4 * 0.02) < 1e-9 and abs(deletes4 - 0.02) < 1e-9, (deletes1, deletes4)
