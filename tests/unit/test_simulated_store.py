"""The simulated S3 behaves as S3 does where the commit protocol can tell: paging, rate limits,
retries, lost responses, and simulated time that is deterministic."""

from __future__ import annotations

import pytest

from tests.doubles.simulated import SimulatedStore, SimulationStalled, SlowDownError, VirtualClock


def test_list_is_paged_and_every_page_is_a_request() -> None:
    s = SimulatedStore(page_size=1000)
    for i in range(2500):
        s.inner.put(f"d/k{i:05d}", b"")
    s.put("d/zz", b"x")  # through the store: indexed
    s.reindex()
    s.stats.reset()
    assert len(list(s.list("d/"))) == 2501
    assert s.stats.requests["LIST"] == 3
    names, folders = s.list_dir("")
    assert (names, folders) == ([], ["d"])
    assert s.stats.requests["LIST"] == 4  # one folder: one page


def test_list_dir_pages_count_folders() -> None:
    s = SimulatedStore(page_size=10)
    for i in range(25):
        s.put(f"step_{i:03d}/a", b"")
        s.put(f"step_{i:03d}/b/c", b"")
    s.put("top", b"")
    s.stats.reset()
    names, folders = s.list_dir("")
    assert names == ["top"] and folders == [f"step_{i:03d}" for i in range(25)]
    assert s.stats.requests["LIST"] == 3


def test_a_key_written_between_pages_is_listed_if_it_sorts_after_the_marker() -> None:
    s = SimulatedStore(page_size=2)
    for k in ("a", "c", "e"):
        s.put(f"p/{k}", b"")
    it = s.list("p/")
    assert next(it).key == "p/a"
    s.put("p/f", b"")  # after the first page's marker: seen
    s.put("p/b", b"")  # before it: not seen, as on S3
    assert [i.key for i in it] == ["p/c", "p/e", "p/f"]


def _hammer(store: SimulatedStore, clock: VirtualClock, n: int, verb: str) -> list[str]:
    results: list[str] = []

    def one(i: int) -> None:
        try:
            if verb == "PUT":
                store.put(f"hot/k{i}", b"x")
            else:
                store.exists("hot/k")
            results.append("ok")
        except SlowDownError:
            results.append("slowdown")

    for i in range(n):
        clock.spawn(lambda i=i: one(i), at=i * 1e-5)  # n requests inside a tenth of a second
    clock.run()
    return results


def test_over_the_put_rate_of_a_prefix_is_slowed_down_and_retried() -> None:
    clock = VirtualClock()
    s = SimulatedStore(clock, latency=0.02, put_limit=3500, attempts=12)
    results = _hammer(s, clock, 4000, "PUT")
    assert s.stats.slowdowns > 0  # the first 3500 in one second pass, the rest are told to slow down
    assert results.count("ok") == 4000  # and get through on retry, after the window moved on
    assert s.stats.requests["PUT"] == 4000 + s.stats.slowdowns
    assert s.stats.peak[("PUT", "hot")] == 3500


def test_without_retries_a_slowdown_is_an_error() -> None:
    clock = VirtualClock()
    s = SimulatedStore(clock, latency=0.02, get_limit=100, attempts=1)
    results = _hammer(s, clock, 150, "HEAD")
    assert results.count("slowdown") == 50 and s.stats.slowdowns == 50


def test_other_prefixes_are_not_limited_together() -> None:
    clock = VirtualClock()
    s = SimulatedStore(clock, latency=0.02, put_limit=10, attempts=1)
    for i in range(50):
        clock.spawn(lambda i=i: s.put(f"p{i}/k", b""))
    clock.run()
    assert s.stats.slowdowns == 0


def test_simulated_time_passes_without_wall_time_and_is_deterministic() -> None:
    def run(seed: int) -> tuple[float, list[float]]:
        clock = VirtualClock()
        s = SimulatedStore(clock, latency=0.02, sigma=0.5, seed=seed)
        done: list[float] = []

        def rank(r: int) -> None:
            for j in range(20):
                s.put(f"r{r}/k{j}", b"x")
            done.append(clock.time())

        for r in range(200):
            clock.spawn(lambda r=r: rank(r))
        return clock.run(), done

    end, done = run(1)
    assert 0.2 < end < 5.0 and len(done) == 200  # 4000 requests of ~20 ms, 200 at a time
    assert run(1) == (end, done)
    assert run(2)[0] != end


def test_lost_response_of_a_conditional_put_still_tells_the_winner() -> None:
    clock = VirtualClock()
    s = SimulatedStore(clock, latency=0.01, lost_rate=0.5, seed=3)
    wins: list[bool] = []
    for _ in range(16):
        clock.spawn(lambda: wins.append(s.put_if_absent("commit.json", b"c")))
    clock.run()
    assert wins.count(True) == 1 and s.stats.errors > 0


def test_injected_errors_are_retried_and_counted() -> None:
    clock = VirtualClock()
    s = SimulatedStore(clock, latency=0.01, error_rate=0.3, seed=5)
    for i in range(50):
        clock.spawn(lambda i=i: s.put(f"k{i}", bytes([i])))
    clock.run()
    assert s.stats.errors > 0 and s.stats.requests["PUT"] == 50 + s.stats.errors
    assert all(s.inner.get(f"k{i}") == bytes([i]) for i in range(50))


def test_a_thread_that_blocks_outside_the_clock_is_reported() -> None:
    import threading

    clock = VirtualClock()
    gate = threading.Event()
    clock.spawn(lambda: gate.wait(2))
    clock.spawn(lambda: clock.sleep(1))
    with pytest.raises(SimulationStalled):
        clock.run(timeout=1)
    gate.set()
