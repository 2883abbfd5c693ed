"""The S3 store under throttling and at retention scale (issue 31), against moto's real server
through ``tests.doubles.faults.FaultProxy``: SlowDowns make the whole store (every thread)
send fewer requests and the save still commits; a store that only ever gets SlowDowns fails
with one error after its tries; DeleteObjects' per-key errors are retried, never left silently;
``purge`` sends its batches of 1000 keys several at a time."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from ckptd import catalog
from storage_backends import StorageError
from storage_backends.s3 import S3Store
from storage_backends.s3_retry import BETA, AdaptiveLimiter
from tests.doubles.faults import FaultPlan, FaultProxy, Rule
from tests.faults.workers import campaign_state
from tests.server.daemon import wait_for
from trainer_hooks import Checkpointer

pytestmark = [pytest.mark.s3, pytest.mark.timeout(300)]


def _split(uri: str) -> tuple[str, str]:
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    return bucket, prefix


def _is_step_put(r) -> bool:
    return r.op == "PutObject" and "/step_" in r.path


def _is_data_put(r) -> bool:
    return r.op == "PutObject" and "/arrays/" in r.path


def test_a_save_commits_through_a_burst_of_slowdowns_and_the_store_slows_down(s3_server, s3_bucket, monkeypatch):
    """503 SlowDown on the save's first data PUTs: the store cuts its own rate for the step's
    scope (a limit the rest of the save runs under) and the save commits."""
    plan = FaultPlan(rules=[Rule(_is_data_put, "503", times=4)])
    with FaultProxy(s3_server, plan) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        monkeypatch.setenv("CKPTD_S3_MAX_ATTEMPTS", "1")  # our retries only: short backoffs
        monkeypatch.setenv("CKPTD_S3_RETRIES", "8")
        monkeypatch.setenv("CKPTD_S3_MIN_RATE", "20")
        with Checkpointer(s3_bucket) as ck:
            ck.save(1, campaign_state(1)).result(timeout=240)
            limiter = ck.store.limiter
            assert proxy.counters["fault:503"] == 4
            assert limiter.throttles == 4 and limiter.cuts >= 1
            assert limiter.rate("step_0000000001") is not None  # still paced at the end of the save
            assert limiter.rate("_latest") is None  # other scopes were never throttled
    with _open(s3_bucket, s3_server) as store:
        assert catalog.latest_step(store) == 1


def _open(uri: str, endpoint_url: str | None = None) -> S3Store:
    bucket, prefix = _split(uri)
    return S3Store(bucket, prefix, endpoint_url=endpoint_url)


def test_the_rate_is_shared_by_the_store_threads(s3_server, s3_bucket):
    """Eight threads of one store put one step's objects; after SlowDowns answered to a few
    PUTs, every thread waits for the step's tokens (one bucket per scope for the whole store),
    so the store sends fewer requests per second: its throttled sleeps are counted per thread."""
    bucket, prefix = _split(s3_bucket)
    plan = FaultPlan(rules=[Rule(_is_step_put, "503", times=8)])
    with FaultProxy(s3_server, plan) as proxy, S3Store(bucket, prefix, endpoint_url=proxy.url, min_rate=1) as store:
        with ThreadPoolExecutor(8, thread_name_prefix="writer") as pool:
            list(pool.map(lambda i: store.put(f"step_1/k{i:03d}", b"x"), range(40)))
        assert sorted(i.key for i in store.list("step_1/")) == [f"step_1/k{i:03d}" for i in range(40)]
        assert proxy.counters["fault:503"] == 8
        limiter = store.limiter
        assert limiter.cuts >= 1
        assert len([t for t in limiter.waits_by_thread if t.startswith("writer")]) >= 2


def test_only_slowdowns_fail_the_put_once_after_its_tries(s3_server, s3_bucket):
    bucket, prefix = _split(s3_bucket)
    plan = FaultPlan(rules=[Rule(_is_step_put, "503", times=10**6)])
    with FaultProxy(s3_server, plan) as proxy:
        s = S3Store(bucket, prefix, endpoint_url=proxy.url, max_attempts=2, retries=1, backoff=0.01, min_rate=50)
        with s, pytest.raises(StorageError, match="SlowDown") as e:
            s.put("step_1/k", b"x")
        assert "\n" not in str(e.value) and "after 4 attempts" in str(e.value)
        assert proxy.counters["op:PutObject"] == 4  # max_attempts 2 x (retries 1 + 1), then it stops


def test_throttles_enough_to_drain_botocore_retry_quota_fail_no_put(s3_server, s3_bucket):
    """Every one of 80 PUTs gets 5 SlowDowns before it succeeds: 400 throttled tries, far past
    what botocore's retry quota allows a client (500 tokens, 5 per throttled retry: 100). At the
    default tries (8 attempts x (4 retries + 1) = 40) a paced store makes every try itself, so
    none is cut short: every PUT lands on its 6th. With botocore retrying, the quota ran dry
    after ~20 PUTs and each later PUT got 5 tries (1 of botocore's per try of ours), all of
    them SlowDowns, so PUTs failed."""
    bucket, prefix = _split(s3_bucket)
    keys = [f"step_1/k{i:03d}" for i in range(80)]
    rules = [Rule(lambda r, k=k: r.op == "PutObject" and r.path.endswith("/" + k), "503", times=5) for k in keys]
    with FaultProxy(s3_server, FaultPlan(rules=rules)) as proxy:
        s = S3Store(bucket, prefix, endpoint_url=proxy.url, backoff=0.01, min_rate=50)
        with s, ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda k: s.put(k, b"x"), keys))
            assert sorted(i.key for i in s.list("step_1/")) == keys
        assert proxy.counters["fault:503"] == 400
        assert proxy.counters["op:PutObject"] == 480  # 6 tries each: 5 throttled, then it landed


def _fill(uri: str, n: int) -> list[str]:
    """``n`` small objects under ``step_1/``, written straight to moto."""
    keys = [f"step_1/arrays/w/c/{i}" for i in range(n)]
    with _open(uri) as store, ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: store.put(k, b"x"), keys))
    return keys


def test_per_key_delete_errors_are_retried(s3_server, s3_bucket):
    keys = _fill(s3_bucket, 10)
    bucket, prefix = _split(s3_bucket)
    plan = FaultPlan(rules=[Rule(lambda r: r.op == "DeleteObjects", "keyerrors")])
    with FaultProxy(s3_server, plan) as proxy, S3Store(bucket, prefix, endpoint_url=proxy.url, backoff=0.01) as s:
        assert s.purge("step_1/") == (10, 10)
        assert proxy.counters["fault:keyerrors"] == 1
        assert proxy.counters["op:DeleteObjects"] == 2  # the 5 failed keys went again
    with _open(s3_bucket) as store:
        assert [i.key for i in store.list("step_1/")] == []
    assert len(keys) == 10


def test_keys_that_keep_failing_fail_the_purge_naming_them(s3_server, s3_bucket):
    _fill(s3_bucket, 10)
    bucket, prefix = _split(s3_bucket)
    plan = FaultPlan(rules=[Rule(lambda r: r.op == "DeleteObjects", "keyerrors", times=10**6)])
    with FaultProxy(s3_server, plan) as proxy:
        s = S3Store(bucket, prefix, endpoint_url=proxy.url, retries=2, backoff=0.01)
        with s, pytest.raises(StorageError, match="InternalError") as e:
            s.purge("step_1/")
        assert proxy.counters["op:DeleteObjects"] == 3  # 1 + 2 retries of the failing keys
    with _open(s3_bucket) as store:
        left = [i.key for i in store.list("step_1/")]
    # each round deletes every other key it sends: 10 -> 5 -> 2 -> 1 key left, and named
    assert len(left) == 1 and "1 of 10 keys not deleted after 3 attempts" in str(e.value)
    assert f"/job/{left[0]}:" in str(e.value)


def test_purge_sends_its_batches_in_parallel(s3_server, s3_bucket):
    """3500 keys are 4 DeleteObjects; the proxy holds each one until all 4 are in flight at once
    (a sequential purge would never send the second)."""
    _fill(s3_bucket, 3500)
    bucket, prefix = _split(s3_bucket)
    plan = FaultPlan(rules=[Rule(lambda r: r.op == "DeleteObjects", "late", times=4)])
    with FaultProxy(s3_server, plan) as proxy, S3Store(bucket, prefix, endpoint_url=proxy.url) as s:
        out: list = []
        t = threading.Thread(target=lambda: out.append(s.purge("step_1/")))
        t.start()
        try:
            wait_for(lambda: proxy.counters["fault:late:DeleteObjects"] == 4, "4 DeleteObjects in flight", 60)
            assert proxy.peak["DeleteObjects"] == 4
        finally:
            proxy.release_late()
            t.join(120)
        assert out == [(3500, 3500)]
        assert proxy.counters["op:DeleteObjects"] == 4
    with _open(s3_bucket) as store:
        assert list(store.list("step_1/")) == []


def _manual_limiter() -> tuple[AdaptiveLimiter, list[float], list[float]]:
    """A limiter at the 0.2/s floor on a clock the test moves: (limiter, [now], the sleeps it
    asked for, each of which moves the clock)."""
    now = [0.0]
    slept: list[float] = []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    return AdaptiveLimiter(min_rate=0.2, clock=lambda: now[0], sleep=sleep), now, slept


def test_the_limiter_rule_on_a_manual_clock():
    """The rule itself, on a clock the test moves: no limit before a throttle; one cut per round
    trip (throttles of requests sent before the cut are ignored); the floor; the additive
    regrowth, then the limit lifted."""
    lim, now, slept = _manual_limiter()
    sent = [lim.acquire("step_1") for _ in range(10)]  # 10 requests in the same instant
    assert slept == [] and lim.rate("step_1") is None
    for t in sent:  # all 10 throttled: one cut, to BETA x the 10/s sent
        lim.record("step_1", t, throttled=True)
    assert lim.cuts == 1 and lim.rate("step_1") == pytest.approx(BETA * 10)
    assert lim.rate("other") is None
    t = lim.acquire("step_1")
    assert slept and slept[-1] == pytest.approx(1 / (BETA * 10))  # the next one waits for a token
    lim.record("step_1", t, throttled=True)  # sent after the cut: cuts again
    assert lim.cuts == 2
    for _ in range(30):  # a throttle per round trip drives the rate to the floor, not below
        lim.record("step_1", lim.acquire("step_1"), throttled=True)
    assert lim.rate("step_1") == pytest.approx(0.2)
    while lim.rate("step_1") is not None:  # successes grow it back; at twice the cut it is lifted
        lim.record("step_1", lim.acquire("step_1"), throttled=False)
    assert lim.acquire("step_1") == now[0]  # no wait once lifted


def test_consecutive_throttles_wait_at_most_one_token_at_the_floor():
    """One thread whose every request is throttled: each waits for one token at the floor rate,
    at most 1 / min_rate (the module's bound: requests waiting / min_rate), however many
    throttles came before. A cut that forgot the tokens refilled while a request waited made
    every later request pay that wait again: 0, 1.4, 4.1 ... 120 s by the 25th."""
    lim, now, slept = _manual_limiter()
    for _ in range(200):
        sent = lim.acquire("step_1")
        now[0] += 0.1  # the round trip
        lim.record("step_1", sent, throttled=True)
    assert lim.cuts == 200 and lim.rate("step_1") == pytest.approx(0.2)
    assert max(slept) <= 1 / 0.2 + 1e-9


def test_many_threads_throttled_wait_at_most_their_number_over_the_floor():
    """16 threads of one store, every request throttled, driven on a virtual clock (events in
    time order; no thread sleeps): no request waits longer than 16 / min_rate, the time for the
    15 others' reservations and its own token at the floor."""
    import heapq

    threads, min_rate, rtt = 16, 0.2, 0.05
    now = [0.0]
    lim = AdaptiveLimiter(min_rate=min_rate, clock=lambda: now[0], sleep=lambda s: None)
    events = [(0.001 * i, i, None) for i in range(threads)]  # (time, thread, sent: None = about to send)
    waits = []
    while len(waits) < 2000:
        now[0], i, sent = heapq.heappop(events)
        if sent is None:
            sent = lim.acquire("step_1")
            waits.append(sent - now[0])
            heapq.heappush(events, (sent + rtt, i, sent))
        else:
            lim.record("step_1", sent, throttled=True)
            heapq.heappush(events, (now[0], i, None))
    assert lim.rate("step_1") == pytest.approx(min_rate)
    assert max(waits) <= threads / min_rate + 1e-6


@pytest.mark.parametrize(("threads", "min_rate", "seed"), [(4, 0.2, 1), (16, 0.2, 2), (32, 5.0, 3)])
def test_no_wait_passes_the_bound_whatever_the_answers(threads, min_rate, seed):
    """Threads of one store on a virtual clock (``tests.doubles.sim_clock``: the limiter really
    sleeps, in simulated seconds), answers a seeded mix of throttles and successes whose share
    changes every 30 s, so scopes are cut, grow back, are lifted and cut again: no request waits
    longer than the requests then waiting in its scope, itself included, over the floor. A cut
    that forgot the tokens refilled while requests waited let the debt grow past it."""
    import random

    from tests.doubles.sim_clock import VirtualClock

    clock, rng = VirtualClock(), random.Random(seed)
    lim = AdaptiveLimiter(min_rate=min_rate, clock=clock.time, sleep=clock.sleep)
    waiting, over = [0], []

    def writer() -> None:
        for _ in range(60):
            bound = (waiting[0] + 1) / min_rate
            start = clock.time()
            waiting[0] += 1
            sent = lim.acquire("step_1")
            waiting[0] -= 1
            if clock.time() - start > bound + 1e-6:
                over.append((start, clock.time() - start, bound))
            clock.sleep(rng.choice([0.01, 0.1, 2.0]))  # the round trip
            share = (0.0, 0.3, 0.9)[int(clock.time() // 30) % 3]
            lim.record("step_1", sent, throttled=rng.random() < share)
            clock.sleep(rng.choice([0.0, 0.0, rng.uniform(0, 3)]))

    for i in range(threads):
        clock.spawn(writer, at=0.001 * i)
    clock.run(timeout=120)
    assert lim.cuts > 1 and over == []
