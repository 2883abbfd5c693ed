"""The commit protocol at 64 ... 8192 ranks on a simulated S3 (``python -m benchmarks.scale``).

Every simulated rank is a thread of a :class:`~tests.doubles.simulated.VirtualClock`, and it
runs the real code a rank runs after its snapshot: ``persist`` (its data, its done record, the
commit attempt, waiting for the commit), ``latest_step``, ``load_manifest`` and the done-record
read of a restore, against a :class:`~tests.doubles.simulated.SimulatedStore` (log-normal
latency, LIST pages of 1000 keys, SlowDown above 3500 PUT/s and 5500 GET/s per prefix, every
request counted). Only the clock is replaced: the modules under test read ``time`` through
:func:`virtual_time`, so their polling sleeps and deadlines run in simulated seconds. Figures
are in simulated seconds; wall time is only what the simulation costs.

Every rank starts its ``persist`` within ``start_s`` of the others (``save()`` is collective,
the snapshots end nearly together): the claim of the step comes first, then the upload. The
finish times of the ranks are skewed as a real job's are: every rank uploads for
``write_s`` x (1 + N(0, ``skew``)) seconds, and 1% of them straggle by an extra exponential
``straggle_s``. "Commit latency" is from the moment the last rank's data is durable (its last
data PUT answered) to the moment ``commit.json`` is; "all ranks know" is to the moment the last
rank's ``persist`` returned (it polls for the commit).

Figures, each against N: commit latency; requests per save by verb; the peak requests in one
second on one prefix; SlowDowns; restore-planning requests and time at M = N ranks; and
``latest_step()`` requests and time against the number of steps in the root.
Writes ``benchmarks/scale_results.json`` (merged by ``--label``) and, with ``--plot``, the
chart ``benchmarks/SCALE.png`` comparing the labels.

``--realistic`` (issue 31) runs the job users run instead of the easy one above: a manifest of
``--arrays`` arrays sharded over the ranks, done records naming and pinning every shard, rank
0's 16 I/O threads, a daemon's 2 upload workers and 16 I/O threads, the CPU of every simulated
thread charged to its virtual time (``VirtualClock(cpu_scale=...)``), the S3 store's HEAD after
a 412 and batch purge, a full-size checkpoint for retention to delete, and the save's data PUTs
and a restore's GETs against S3's partitions, request by request with the real limiter
(:func:`simulate_partitions`). See :class:`Realistic` and SCALE.md.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import random
import sys
import threading
import time as _real_time
from concurrent.futures import Future
from pathlib import Path

from ckptd import catalog
from ckptd import commit as commit_mod
from ckptd import manifest as mf
from ckptd import persist as persist_mod
from tests.doubles.simulated import (
    GET_CLASS,
    PUT_CLASS,
    SimulatedStore,
    VirtualClock,
    VirtualEvent,
    VirtualTime,
)

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "scale_results.json"
SIZES = (64, 256, 1024, 4096, 8192)
STEPS = (10, 100, 1000, 10000)


def _protocol_modules() -> list:
    """The modules whose clock the simulation replaces: the ones the save and commit run (the
    claim, one rank's write, the commit and its wait, retention, the daemon's shared claim)."""
    from ckptd import claims, commit, leases, persist, retention
    from ckptd.server import shared_claim

    return [catalog, claims, commit, leases, persist, retention, shared_claim]


@contextlib.contextmanager
def virtual_time(clock: VirtualClock, epoch: float | None = None):
    """The protocol modules read ``clock`` (from ``epoch``, VirtualTime's default if None)."""
    saved = [(m, m.time) for m in _protocol_modules() if hasattr(m, "time")]
    for m, _ in saved:
        m.time = VirtualTime(clock) if epoch is None else VirtualTime(clock, epoch)
    try:
        yield
    finally:
        for m, t in saved:
            m.time = t


class ClockPool:
    """An executor whose tasks are simulated threads of ``clock``: a rank's puts run in parallel,
    as the I/O pool of a real rank runs them, and ``result()`` waits in simulated time. With
    ``workers``, at most that many tasks run at once (a ``ThreadPoolExecutor(workers)``: rank
    0's 16 I/O threads), the rest queue in submission order."""

    def __init__(self, clock: VirtualClock, workers: int | None = None) -> None:
        self.clock, self.workers, self.running = clock, workers, 0
        self.queue: list = []

    def submit(self, fn, /, *args, **kwargs) -> Future:
        f = _ClockFuture(self.clock)

        def body() -> None:
            try:
                f.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
                f.set_exception(e)
            f.event.set()
            self.running -= 1
            if self.queue:
                self.running += 1
                self.clock.spawn(self.queue.pop(0), name="io")

        if self.workers is not None and self.running >= self.workers:
            self.queue.append(body)
        else:
            self.running += 1
            self.clock.spawn(body, name="io")
        return f


class ClockSemaphore:
    """``threading.Semaphore`` for simulated threads (a daemon's ``upload_workers``)."""

    def __init__(self, clock: VirtualClock, value: int) -> None:
        self.clock, self.value, self.waiters = clock, value, []

    def __enter__(self):
        while self.value <= 0:
            ev = VirtualEvent(self.clock)
            self.waiters.append(ev)
            self.clock.wait(ev)
        self.value -= 1
        return self

    def __exit__(self, *exc) -> None:
        self.value += 1
        if self.waiters:
            self.waiters.pop(0).set()


class _ClockFuture(Future):
    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self.clock, self.event = clock, VirtualEvent(clock)

    def result(self, timeout=None):
        self.clock.wait(self.event)
        return super().result(0)

    def exception(self, timeout=None):
        self.clock.wait(self.event)
        return super().exception(0)


class InlinePool:
    """An executor that runs each task at once in the caller (a simulated rank's thread)."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        f: Future = Future()
        try:
            f.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
            f.set_exception(e)
        return f


COMMIT_TIMEOUT = [3600.0]  # --commit-timeout: how long a rank waits for the commit
RETENTION_S: dict[int, float] = {}  # rank -> simulated seconds its retention took (the committer's)
IO_THREADS = [None]  # --realistic: a daemon's io_threads (16), else none (its jobs' puts run inline)
UPLOAD_WORKERS = [10**9]  # --realistic: a daemon's upload_workers (2 by default), else unbounded


def _clock_now() -> float:
    from ckptd import retention

    return retention.time.monotonic()  # the virtual clock while a simulation runs


def _persist(store, job, keep_last, on_result=None, pool=None):
    """One rank's real save protocol (``ckptd.persist``): claim, data, done record, commit, wait
    for the commit (``on_result`` is called then: the rank's future resolves there), then
    retention by the committing rank."""
    from ckptd import persist, retention

    result = persist.persist(store, job, pool or InlinePool(), commit_timeout=COMMIT_TIMEOUT[0], heartbeat=False)
    if on_result is not None:
        on_result(result)
    t0 = _clock_now()
    retention.after_commit(store, result, keep_last)
    if result.committed_here:
        RETENTION_S[job.rank] = _clock_now() - t0
    return result


class _SimEvent:
    """``threading.Event`` for :class:`ckptd.server.shared_claim.SharedClaim` on the virtual clock."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock, self.event = clock, VirtualEvent(clock)

    def set(self) -> None:
        self.event.set()

    def wait(self) -> None:
        self.clock.wait(self.event)


class _Daemon:
    """One ``ckptd serve`` of the simulation: its shared claim, and its commit watch (one read
    of the commit record per check for all its jobs of the attempt, as ``Runner._loop``)."""

    def __init__(self, clock: VirtualClock) -> None:
        from ckptd.server.shared_claim import SharedClaim

        self.claim = SharedClaim(on_begin=self._begun, event=lambda: _SimEvent(clock))
        self.known, self.watching, self.poller, self.begins = VirtualEvent(clock), 0, False, 0
        self.uploads = ClockSemaphore(clock, UPLOAD_WORKERS[0])  # Settings.upload_workers
        # Settings.io_threads: the puts of all its jobs (--realistic); else inline, as before
        self.io = ClockPool(clock, IO_THREADS[0]) if IO_THREADS[0] else InlinePool()

    def _begun(self) -> None:
        self.begins += 1


def _daemon_job(store, job, keep_last, daemon: _Daemon, clock: VirtualClock, on_result=None):
    """One rank's job through a ``ckptd serve`` (``ckptd.server.jobs``), with the requests it
    makes: the hand-off's check that the step is not committed and the upload's (one shared
    read of the commit record each, ``SharedClaim.committed``), the claim shared by the
    daemon's ranks, ``persist(claim="caller",
    wait=False)``, then the daemon's commit watch: its first waiting job reads the commit record
    for all, every ``min(0.01 + waited / 10, 0.5)`` s and at least (N / jobs waiting) / 2000 s
    (jittered) on the watcher's 0.02 s tick."""
    from ckptd import persist, retention
    from ckptd.errors import AlreadyCommitted

    if daemon.claim.committed(store, "sim", job.step) is not None:  # Runner._refuse_committed
        raise AlreadyCommitted(f"step {job.step} is committed")
    daemon.claim.committed(store, "sim", job.step)  # Runner._upload: committed (by this attempt) already?
    daemon.claim.claim(store, "sim", job.step, job.attempt, job.attempt)
    with daemon.uploads:  # Runner: at most upload_workers jobs upload at once
        result = persist.persist(
            store, job, daemon.io, commit_timeout=COMMIT_TIMEOUT[0], wait=False, claim="caller", heartbeat=False
        )
    if not result.committed_here:
        daemon.watching += 1
        if daemon.poller:
            clock.wait(daemon.known)
        else:
            daemon.poller, since, rng = True, clock.time(), random.Random(job.rank)
            while not daemon.known.is_set:
                with contextlib.suppress(Exception):
                    if catalog.read_commit(store, job.step) is not None:
                        daemon.known.set()
                        break
                waited = clock.time() - since
                if waited > COMMIT_TIMEOUT[0]:
                    raise TimeoutError(f"step {job.step} not committed")
                pause = min(0.01 + waited / 10, 0.5)
                if job.world_size > 64:
                    pause = max(pause, job.world_size / daemon.watching / 2000 * (0.5 + rng.random()))
                clock.sleep(0.02 * math.ceil(pause / 0.02))
    if on_result is not None:
        on_result(result)
    t0 = _clock_now()
    retention.after_commit(store, result, keep_last)
    if result.committed_here:
        RETENTION_S[job.rank] = _clock_now() - t0
    return result


def _job(step: int, attempt: str, rank: int, world: int, objects: int):
    try:
        from ckptd.savejob import SaveJob
    except ImportError:  # before it moved to ckptd
        from trainer_hooks.snapshot import SaveJob

    # Each rank's shards live in folders of their own (zarr chunk keys c/<rank>/...), as a
    # dim-0 sharded tensor's do; rank 0 also writes the manifest and the group nodes.
    meta = [(f"arrays/t{j}/c/{rank}/0", b"s" * 64) for j in range(objects)]
    if rank == 0:
        m = mf.Manifest(step=step, world_size=world, tensors={}, state={}, attempt=attempt)
        meta += [("zarr.json", mf.group_metadata()), (mf.MANIFEST, m.to_bytes())]
    return SaveJob(step=step, attempt=attempt, rank=rank, world_size=world, metadata=meta)


class Realistic:
    """``--realistic``: the job users run. The manifest holds ``arrays`` arrays sharded over the
    N ranks (one shard per rank per array, ``benchmarks.pins_cost.manifest``); rank 0 also
    writes each array's ``zarr.json`` through its I/O pool of ``io_threads`` (16, as
    ``trainer_hooks.checkpointer``), the group's and the manifest; every rank's done record
    names its ``arrays`` shard keys and pins them (the real ``donetree.make_pins``), so the
    records, the tree's digests and the committer's check cost what they cost. Only the
    shards' bytes are not sent one request at a time: a rank uploads for its ``write_s``
    (the bulk, as in the default mode) and its ``arrays`` PUTs are counted
    (``SimulatedStore.bulk_put``); their rate against S3's partitions is
    :func:`simulate_partitions`'s subject."""

    SHARD_BYTES, CRC = 256 * 1024 + 4, b"\x00\x01\x02\x03"

    def __init__(self, n: int, arrays: int, step: int, attempt: str) -> None:
        from benchmarks.pins_cost import manifest

        base = manifest(arrays, n)
        self.manifest = mf.Manifest(step, n, base.tensors, {}, attempt)
        self.grids = [(e.path, e.layout) for e in base.tensors.values()]
        self.meta0 = [("zarr.json", mf.group_metadata())]
        self.meta0 += [(f"{e.path}/zarr.json", mf.dumps(e.layout.metadata())) for e in base.tensors.values()]
        self.meta0 += [(mf.MANIFEST, self.manifest.to_bytes())]

    def objects(self, n: int) -> int:
        return n * len(self.grids) + len(self.meta0)

    def job(self, step: int, attempt: str, rank: int, world: int):
        from ckptd.savejob import SaveJob

        meta = self.meta0 if rank == 0 else []
        return SaveJob(step=step, attempt=attempt, rank=rank, world_size=world, metadata=list(meta))

    def writer(self, clock: VirtualClock, bulk_s, on_durable):
        """A stand-in for ``persist._write_data``: the metadata puts are real (create-only, on
        the rank's pool, alongside its bulk upload of ``bulk_s(rank)`` seconds); returns what
        the real one returns, for ``arrays`` shards."""
        from ckptd import donetree

        def write_data(store, part, pool, dedupe, to_numpy, where, written, abort, tags):
            folder = mf.step_dir(part.step)
            written += [f"{folder}/{k}" for k, _ in part.metadata]
            futures = [pool.submit(store.put_new, f"{folder}/{k}", d) for k, d in part.metadata]
            clock.sleep(bulk_s(part.rank))
            keys = [f"{path}/{layout.shard_key((part.rank, 0))}" for path, layout in self.grids]
            store.bulk_put(f"{folder}/arrays/", len(keys))
            for f in futures:
                f.result()
            on_durable(part.rank)
            written += [f"{folder}/{k}" for k in keys]
            pins = donetree.make_pins({k: (self.SHARD_BYTES, self.CRC) for k in keys}, dict(part.metadata))
            return self.SHARD_BYTES * len(keys) + sum(len(d) for _, d in part.metadata), keys, pins

        return write_data


def finish_times(n: int, rng: random.Random, write_s: float, skew: float, straggle_s: float) -> list[float]:
    out = []
    for _ in range(n):
        t = write_s * max(0.5, 1.0 + rng.gauss(0.0, skew))
        if rng.random() < 0.01:
            t += rng.expovariate(1.0 / straggle_s)
        out.append(t)
    return out


def new_store(clock: VirtualClock, args, seed: int, **kw) -> SimulatedStore:
    faults = {"error_rate": getattr(args, "error_rate", 0.0), "lost_rate": getattr(args, "lost_rate", 0.0)}
    kw.setdefault("head_after_412", getattr(args, "realistic", False))  # S3Store's HEAD after a 412
    return SimulatedStore(clock, latency=args.latency, sigma=args.sigma, seed=seed, **faults, **kw)


def _commit_previous(store: SimulatedStore, steps, world: int) -> None:
    """Committed checkpoints written before the measured save (uncounted setup, no time)."""
    clock = VirtualClock()
    setup = SimulatedStore(clock, inner=store.inner, put_limit=10**9, get_limit=10**9)
    with virtual_time(clock):
        for s in steps:
            for r in range(world):
                clock.spawn(lambda s=s, r=r: _persist(setup, _job(s, f"a{s}", r, world, 1), None))
            clock.run()


def simulate_save(n: int, args, seed: int = 0) -> dict:
    """One save of ``n`` ranks on a root that already holds ``args.previous`` checkpoints."""
    rng = random.Random(seed)
    real = getattr(args, "realistic", False)
    clock = VirtualClock(cpu_scale=args.cpu_scale if real else 0.0)
    store = new_store(clock, args, seed)
    step = 1000
    prev = list(range(step - 100 * args.previous, step, 100))
    old_keys = 0
    if prev:
        _commit_previous(store, prev, min(n, 4))
        if real and n * args.arrays <= args.full_previous_max:
            # the checkpoint retention deletes after this save, full size: every rank's shards
            old = mf.step_dir(prev[0])
            shard = Realistic(n, args.arrays, prev[0], f"a{prev[0]}")
            for path, layout in shard.grids:
                for r in range(n):
                    store.inner.put(f"{old}/{path}/{layout.shard_key((r, 0))}", b"")
            old_keys = n * args.arrays
        store.reindex()
    RETENTION_S.clear()
    times = finish_times(n, rng, args.write_s, args.skew, args.straggle_s)
    returned = [0.0] * n
    durable = [0.0] * n
    committers: list[int] = []

    failures: list[str] = []

    starts = [rng.uniform(0.0, args.start_s) for _ in range(n)]
    # Rank 0's I/O pool runs its puts in parallel (it may publish the claim to every group of
    # ranks, as a real thread pool would); the others' run inline (one thread each is cheaper to
    # simulate, and their data puts are one sleep and two requests).
    pool0 = ClockPool(clock, args.io_threads if real else None)
    realistic = Realistic(n, args.arrays, step, "a") if real else None
    claimed = [0.0] * n  # seconds from a rank's start to its first data put
    per = args.daemon  # ranks per daemon (node); 0: every rank persists in-process
    if per:
        daemons = [_Daemon(clock) for _ in range(-(-n // per))]

    def rank(r: int) -> None:
        # Every rank starts persisting when its snapshot is taken (within ``start_s`` of the
        # others: save() is collective): the claim of the step comes first, then the upload.
        clock.sleep(starts[r])
        tls.rank = r
        try:
            job = realistic.job(step, "a", r, n) if real else _job(step, "a", r, n, args.objects)
            done = lambda _: returned.__setitem__(r, clock.time())  # noqa: E731
            if per:
                res = _daemon_job(store, job, args.keep_last, daemons[r // per], clock, done)
            else:
                res = _persist(store, job, args.keep_last, done, pool0 if r == 0 else None)
        except Exception as e:  # noqa: BLE001 - a rank's save failing is a result to report
            failures.append(f"rank {r}: {type(e).__name__}: {e}")
            returned[r] = clock.time()
            return
        if res.committed_here:
            committers.append(r)

    # The rank's data is durable when its last data PUT is answered: record those times.
    orig_put = store.put_new

    def put_new(key, data):
        if "/arrays/" in key:
            r = int(key.split("/c/")[1].split("/")[0])
            if "/arrays/t0/" in key:  # the bulk of its upload, whose requests are not the subject
                claimed[r] = clock.time() - starts[r]  # its claim is settled: it may write
                clock.sleep(times[r])
            tag = orig_put(key, data)
            durable[r] = max(durable[r], clock.time())
            return tag
        return orig_put(key, data)

    if not real:
        store.put_new = put_new  # type: ignore[method-assign]
    # Each rank's requests, to tell the committer's chain from its last data PUT to the commit.
    tls, trace = threading.local(), collections.defaultdict(list)
    orig_request = store._request

    def _request(verb, key, apply, nbytes=0):
        r = getattr(tls, "rank", None)
        if r is not None:
            trace[r].append((clock.time(), verb, key))
        return orig_request(verb, key, apply, nbytes)

    store._request = _request  # type: ignore[method-assign]
    check_cpu: list[float] = []
    orig_check = commit_mod._check_before_commit

    def check(*a, **kw):
        t0 = _real_time.thread_time()
        try:
            return orig_check(*a, **kw)
        finally:
            check_cpu.append(_real_time.thread_time() - t0)

    patches = [(commit_mod, "_check_before_commit", check)]
    if real:

        def on_durable(r: int) -> None:
            durable[r] = clock.time()

        def bulk_s(r: int) -> float:
            claimed[r] = clock.time() - starts[r]
            if per:  # a node's NIC is shared by the jobs uploading at once: fewer at once, each faster
                return times[r] * min(UPLOAD_WORKERS[0], per) / per
            return times[r]

        patches.append((persist_mod, "_write_data", realistic.writer(clock, bulk_s, on_durable)))
    saved = [(m, a, getattr(m, a)) for m, a, _ in patches]
    for m, a, f in patches:
        setattr(m, a, f)
    commit_key = f"{mf.step_dir(step)}/{mf.COMMIT}"
    commit_at: list[float] = []
    orig_pia = store.put_if_absent

    def put_if_absent(key, data):
        won = orig_pia(key, data)
        if won and key == commit_key:
            commit_at.append(clock.time())
        return won

    store.put_if_absent = put_if_absent  # type: ignore[method-assign]
    wall = _real_time.perf_counter()
    try:
        with virtual_time(clock):
            for r in range(n):
                clock.spawn(lambda r=r: rank(r), name=f"rank{r}")
            clock.run(timeout=args.wall_timeout)
    finally:
        for m, a, f in saved:
            setattr(m, a, f)
    wall = _real_time.perf_counter() - wall
    commit = catalog.read_commit(store.inner, step)
    assert commit is None or commit["world_size"] == n, commit
    assert len(committers) <= 1, f"{len(committers)} ranks think they committed"
    if commit is not None:  # never partial: every rank's done record exists
        want = realistic.objects(n) if real else n * args.objects + 2  # + rank 0's manifest and group
        assert commit["objects"] == want, (commit, want)
    t_durable = max(durable)
    t_commit = commit_at[0] if commit_at else None
    # The chain: the committer's requests from its data being durable to commit.json (included).
    chain = []
    if committers and t_commit is not None:
        c = committers[0]
        chain = [f"{v} {k.split('/', 1)[-1] if '/' in k else k}" for t, v, k in trace[c] if durable[c] <= t < t_commit]
    st = store.stats
    verbs = {v: st.requests[v] for v in ("PUT", "GET", "HEAD", "LIST", "DELETE", "COPY")}
    peak_put, peak_put_prefix = st.peak_rate(PUT_CLASS)
    peak_get, peak_get_prefix = st.peak_rate(GET_CLASS)
    return {
        "n": n,
        "committed": commit is not None,
        "failed_ranks": len(failures),
        "first_failure": failures[0] if failures else None,
        "commit_latency_s": None if t_commit is None else t_commit - t_durable,
        "all_know_s": max(returned) - t_durable,
        "requests": verbs,
        "requests_total": st.total(),
        "requests_per_rank": st.total() / n,
        # without the data PUTs (arrays per rank, the same whatever the protocol)
        "protocol_requests_per_rank": (st.total() - st.by_prefix.get(("PUT", f"{mf.step_dir(step)}/arrays"), 0)) / n,
        "peak_put_per_s": peak_put,
        "peak_put_prefix": peak_put_prefix,
        "peak_get_per_s": peak_get,
        "peak_get_prefix": peak_get_prefix,
        "slowdowns": st.slowdowns,
        # the claim of the step: requests on <step>/_claims and its subfolders, and their peak
        "daemon_claims": sum(d.begins for d in daemons) if per else None,  # claims.begin calls
        "claims_requests": sum(c for (_, pre), c in st.by_prefix.items() if "/_claims" in pre),
        "claims_peak_per_s": max((c for (_, pre), c in st.peak.items() if "/_claims" in pre), default=0),
        # how long the claim holds a rank back before its first data put: median and slowest
        "claim_s_median": sorted(claimed)[n // 2],
        "claim_s_max": max(claimed),
        "skew_s": max(times) - min(times),
        "wall_s": wall,
        "realistic": real,
        "arrays": args.arrays if real else 0,
        "daemon": per,
        "previous_full_keys": old_keys,
        "retention_s": max(RETENTION_S.values(), default=None),
        "retention_requests": sum(
            c
            for (v, pre), c in st.by_prefix.items()
            if v in ("LIST", "DELETE") and pre.startswith(mf.step_dir(prev[0]))
        )
        if prev
        else 0,
        "chain_requests": len(chain),
        "chain": chain,
        "check_cpu_s": max(check_cpu, default=None),
        "cpu_charged_s": clock.cpu_charged,
        "requests_by_prefix_top": _top_prefixes(st),
    }


def _top_prefixes(st) -> dict:
    """Requests by kind of prefix (the step's data, done tree, claims, chain, retention)."""
    kinds: collections.Counter = collections.Counter()
    for (verb, pre), c in st.by_prefix.items():
        kind = (
            "arrays"
            if "/arrays" in pre
            else "_done"
            if "/_done" in pre
            else "_claims"
            if "/_claims" in pre
            else "_latest"
            if "_latest" in pre
            else "step"
            if pre.startswith("step_")
            else "root"
        )
        kinds[f"{verb} {kind}"] += c
    return dict(sorted(kinds.items()))


def simulate_latest(steps: int, args, seed: int = 0) -> dict:
    """``latest_step()`` on a root of ``steps`` committed checkpoints (one rank)."""
    clock = VirtualClock()
    store = new_store(clock, args, seed)
    _commit_previous(store, range(0, steps * 10, 10), 1)
    store.reindex()
    got: list = []

    def one() -> None:
        t0 = clock.time()
        got.append((catalog.latest_step(store), clock.time() - t0))

    with virtual_time(clock):
        clock.spawn(one)
        clock.run(timeout=args.wall_timeout)
    latest, seconds = got[0]
    assert latest == (steps - 1) * 10, latest
    return {"steps": steps, "requests": store.stats.total(), "seconds": seconds}


class SimCoordinator:
    """``trainer_hooks.coord.Coordinator`` for simulated ranks: a broadcast is instantaneous
    (the process group is not the subject); the ranks other than ``src`` wait in simulated time
    until ``src`` has contributed."""

    def __init__(self, clock: VirtualClock, slots: dict, rank: int, world_size: int) -> None:
        self.clock, self.slots, self.rank, self.world_size = clock, slots, rank, world_size
        self.enabled = world_size > 1
        self.calls = 0

    def broadcast(self, obj, src: int = 0):
        self.calls += 1
        key = ("broadcast", self.calls)
        if self.rank == src:
            self.slots[key] = obj
            return obj
        while key not in self.slots:
            self.clock.sleep(0.001)
        return self.slots[key]


def simulate_restore(m: int, args, seed: int = 0) -> dict:
    """The discovery and planning reads of a restore at ``m`` ranks, through the real functions
    of ``trainer_hooks.restore``: rank 0 picks the latest step and looks for a reshard plan, the
    manifest is read (by every rank, or by rank 0 and broadcast where restore does that), and
    every rank reads its done record for its RNG state."""
    from trainer_hooks import restore

    clock = VirtualClock()
    store = new_store(clock, args, seed)
    _commit_previous(store, [100, 200], min(m, 64))
    _done_records(store.inner, 200, "a200", m)  # as if step 200 had been saved by m ranks
    store.reindex()
    finished = [0.0] * m
    slots: dict = {}
    failures: list[str] = []

    def rank(r: int) -> None:
        coord = SimCoordinator(clock, slots, r, m)
        (_, step, _), *_ = restore._candidates(store, coord, None, False, None)  # rank 0's pick, broadcast
        src = restore._planned_store(store, coord, step)
        try:
            if hasattr(restore, "_load_manifest"):
                manifest = restore._load_manifest(src, coord, step)
            else:  # before: every rank read it
                manifest = catalog.load_manifest(src, step)
            _read_done(store, manifest, r)
        except Exception as e:  # noqa: BLE001 - a rank's failure is a result to report
            failures.append(f"rank {r}: {type(e).__name__}: {e}")
        finished[r] = clock.time()

    with virtual_time(clock):
        for r in range(m):
            clock.spawn(lambda r=r: rank(r))
        clock.run(timeout=args.wall_timeout)
    st = store.stats
    return {
        "m": m,
        "failed_ranks": len(failures),
        "first_failure": failures[0] if failures else None,
        "requests": st.total(),
        "requests_per_rank": st.total() / m,
        "seconds": max(finished),
        "slowdowns": st.slowdowns,
        "peak_get_per_s": st.peak_rate(GET_CLASS)[0],
    }


def _done_records(inner, step: int, attempt: str, m: int) -> None:
    """The done records of ``m`` ranks in the layout of the code under test (uncounted)."""
    try:
        from ckptd import donetree
    except ImportError:  # before the done tree: flat records
        donetree = None
    for r in range(m):
        rec = {"rank": r, "bytes": 0, "objects": 0}
        if donetree is not None:
            donetree.write_done(inner, step, attempt, r, rec)
        else:
            inner.put(mf.done_key(step, attempt, r), mf.dumps(rec))


def _read_done(store, manifest, rank: int) -> None:
    """The done record a restoring rank reads for its RNG state."""
    reader = getattr(catalog, "read_done_record", None)
    if reader is not None:
        reader(store, manifest.step, manifest.attempt, rank)
    else:
        store.get(mf.done_key(manifest.step, manifest.attempt, rank))


def restore_reads(n: int, m: int, arrays: int) -> dict:
    """The requests of a restore at ``m`` ranks of a save at ``n`` (``Realistic``'s manifest:
    ``arrays`` arrays, each one shard per saving rank), per restoring rank, as the real reader
    makes them: the shard reads of ``layout.plan_reads`` coalesced as ``CheckpointReader`` does
    (one ranged GET per run of chunks), the pins of the done records of the ranks that wrote
    those shards (``restore.pins_for``: one LIST per group of ``donetree.FANOUT`` writers, one
    GET per writer), the rank's own done record for its RNG state (a LIST and a GET) and, on
    rank 0 only, the manifest and the commit record. The benchmark's arrays are identical, so
    one array's plan times ``arrays`` is exact."""
    from benchmarks.pins_cost import manifest
    from ckptd import donetree
    from ckptd.layout import Box, plan_reads, shard_index
    from ckptd.reader import COALESCE_GAP, CheckpointReader

    entry = next(iter(manifest(1, n).tensors.values()))
    layout = entry.layout
    rows, cols = layout.shape
    shard_gets, shard_bytes, writers = [], [], []
    for r in range(m):
        want = Box((r * rows // m, 0), ((r + 1) * rows // m, cols))
        gets = nbytes = 0
        who = set()
        for sr in plan_reads(layout, want):
            who.add(entry.writer_of(shard_index(layout, sr.shard)))
            end = None
            for off, size, _ in sorted(CheckpointReader._computed_spans(layout, sr)):
                if end is None or off - end > COALESCE_GAP:
                    gets += 1
                nbytes += size
                end = off + size
        shard_gets.append(gets * arrays)
        shard_bytes.append(nbytes * arrays)
        writers.append(sorted(who))
    record = len(done_record_bytes(n, arrays))
    per_rank = []
    for r in range(m):
        w = writers[r]
        lists = len({x // donetree.FANOUT for x in w}) + 1  # + its own record's LIST
        gets = shard_gets[r] + len(w) + 1 + (2 if r == 0 else 0)
        per_rank.append(
            {
                "gets": gets,
                "lists": lists,
                "shard_gets": shard_gets[r],
                "records": len(w) + 1,
                "bytes": shard_bytes[r] + record * (len(w) + 1),
            }
        )
    return {
        "n": n,
        "m": m,
        "per_rank_gets": max(x["gets"] for x in per_rank),
        "per_rank_shard_gets": max(shard_gets),
        "per_rank_lists": max(x["lists"] for x in per_rank),
        "per_rank_records": max(x["records"] for x in per_rank),
        "per_rank_bytes": max(x["bytes"] for x in per_rank),
        "gets": sum(x["gets"] for x in per_rank),
        "lists": sum(x["lists"] for x in per_rank),
        "bytes": sum(x["bytes"] for x in per_rank),
        "record_bytes": record,
        "counts": [x["gets"] + x["lists"] for x in per_rank],
    }


def done_record_bytes(n: int, arrays: int) -> bytes:
    """A done record of ``Realistic``'s save, as ``persist`` writes it: its rank's shard keys and
    their pins (``donetree.make_pins``)."""
    import json as _json

    from ckptd import donetree

    r = Realistic(n, arrays, 1, "a")
    keys = [f"{path}/{layout.shard_key((n - 1, 0))}" for path, layout in r.grids]
    rec = {
        "rank": n - 1,
        "writer": "x" * 32,
        "bytes": Realistic.SHARD_BYTES * arrays,
        "objects": arrays,
        "shards": keys,
        "pins": donetree.make_pins({k: (Realistic.SHARD_BYTES, Realistic.CRC) for k in keys}, {}),
        "time": 1.0e9,
    }
    return _json.dumps(rec, separators=(",", ":")).encode()


def simulate_partitions(n: int, args, seed: int = 0) -> dict:
    """One save's data PUTs (``arrays`` per rank) and the GETs of a restore of it at M = N/4,
    N/2 and N against S3's partitions of the step's key range, request by request
    (:class:`~tests.doubles.sim_requests.RequestPartitionModel`): every rank a paced
    ``S3Store`` with the real ``AdaptiveLimiter`` and its retries, ``--model-clients`` clients
    at most (identical ranks aggregated, see the model's assumptions). A rank's other PUTs (its
    done record, rank 0's array metadata: under 0.2 % of the save's) are left out here; the
    ``save`` run above counts them."""
    from tests.doubles.sim_requests import Client, RequestPartitionModel, aggregate_for

    rng = random.Random(seed)
    g = aggregate_for(n, args.model_clients)
    hold = args.write_s * args.io_threads / max(1, args.arrays)  # a rank's PUTs take write_s
    clients = [Client(args.arrays, rng.uniform(0.0, args.start_s)) for _ in range(n // g)]
    save = RequestPartitionModel(rate=3500.0, hold_s=hold, threads=args.io_threads, aggregate=g, seed=seed)
    out: dict = {
        "n": n,
        "arrays": args.arrays,
        "puts": n * args.arrays,
        "objects": n * args.arrays,
        "bytes": n * args.arrays * Realistic.SHARD_BYTES,
        "hold_s": hold,
        "save": save.run(clients),
    }
    out["restore"] = []
    for m in (n // 4, n // 2, n):
        reads = restore_reads(n, m, args.arrays)
        gm = aggregate_for(m, args.model_clients)
        counts = reads.pop("counts")
        cl = [Client(counts[i * gm], rng.uniform(0.0, args.start_s)) for i in range(m // gm)]
        model = RequestPartitionModel(rate=5500.0, hold_s=hold, threads=args.io_threads, aggregate=gm, seed=seed)
        reads["model"] = model.run(cl)
        out["restore"].append(reads)
    return out


# -- report -----------------------------------------------------------------------------------------


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    styles = {
        "before": ("tab:red", "--", "o"),
        "after": ("tab:blue", "-", "s"),
        "realistic": ("tab:orange", "-", "*"),
        "realistic-daemon8": ("tab:brown", "-", "P"),
    }
    others = iter([("tab:green", ":", "^"), ("tab:purple", ":", "v"), ("tab:gray", ":", "D"), ("tab:olive", ":", "x")])
    for label, res in results.items():
        color, ls, marker = styles.get(label) or next(others, ("tab:gray", ":", "^"))
        kw = {"color": color, "linestyle": ls, "marker": marker, "label": label}
        saves = res.get("save", [])
        ns = [s["n"] for s in saves]
        if saves:
            lat = [math.nan if s["commit_latency_s"] is None else s["commit_latency_s"] for s in saves]
            axes[0][0].plot(ns, lat, **kw)
            know = [s["all_know_s"] for s in saves]
            axes[0][0].plot(ns, know, **{**kw, "alpha": 0.4, "label": f"{label}: all ranks know"})
            axes[0][1].plot(ns, [s["requests_per_rank"] for s in saves], **kw)
            axes[0][2].plot(ns, [s["peak_put_per_s"] for s in saves], **{**kw, "label": f"{label}: PUT"})
            gets = [s["peak_get_per_s"] for s in saves]
            axes[0][2].plot(ns, gets, **{**kw, "alpha": 0.4, "label": f"{label}: GET+HEAD+LIST"})
            axes[1][0].plot(ns, [max(s["slowdowns"], 0.5) for s in saves], **kw)
        rest = res.get("restore", [])
        if rest:
            ms = [r["m"] for r in rest]
            axes[1][1].plot(ms, [r["requests_per_rank"] for r in rest], **kw)
            axes[1][1].plot(ms, [r["seconds"] for r in rest], **{**kw, "alpha": 0.4, "label": f"{label}: s"})
        lat_steps = res.get("latest", [])
        if lat_steps:
            axes[1][2].plot([x["steps"] for x in lat_steps], [x["requests"] for x in lat_steps], **kw)
    titles = [
        ("commit latency after the last rank is durable (s)", "log"),
        ("requests per save / N", "log"),
        ("peak requests/s on one prefix", "log"),
        ("SlowDowns per save (0 drawn at 0.5)", "log"),
        ("restore planning at M ranks: requests/rank, seconds", "log"),
        ("latest_step(): requests vs steps in the root", "log"),
    ]
    for ax, (title, yscale) in zip(axes.flat, titles, strict=True):
        ax.set_title(title, fontsize=10)
        ax.set_xscale("log", base=2)
        ax.set_yscale(yscale)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].axhline(1.0, color="k", lw=0.8, ls=":")
    axes[0][2].axhline(3500, color="k", lw=0.8, ls=":")
    axes[0][2].axhline(5500, color="k", lw=0.8, ls="-.")
    for ax in axes[1][:2]:
        ax.set_xlabel("ranks N (M)")
    axes[0][0].set_xlabel("ranks N")
    axes[1][2].set_xlabel("committed steps in the root")
    axes[1][2].set_xscale("log", base=10)
    fig.suptitle("ckptd commit protocol on simulated S3 (20 ms median request, LIST 1000/page, 3500/5500 per prefix)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def partition_table(results: dict) -> list[str]:
    """Markdown tables of the request-level partition model's saves and restores."""
    out = [
        "",
        "| N | objects (= PUTs) | bytes | PUTs per folder | clients x g | duration s | SlowDowns | failed PUTs "
        "| ranks with a failed PUT | longest wait for a token s | partitions at the end (splits at s) |",
        "|" + "---|" * 11,
    ]
    rows = [p for res in results.values() for p in res.get("partitions", []) if "save" in p]
    for p in sorted(rows, key=lambda p: p["n"]):
        x = p["save"]
        splits = ", ".join(f"{t:.0f}" for t in x["splits"]) or "-"
        out.append(
            f"| {p['n']} | {p['objects']:,} | {p['bytes'] / 2**30:.0f} GiB | 1 | {x['clients']} x {x['aggregate']} "
            f"| {x['seconds']:.0f} | {x['slowdowns']:,} | {x['failed']:,} | {x['clients_failed']:,} "
            f"| {x.get('max_wait_s', 0):.0f} | {x['partitions']} ({splits}) |"
        )
    out += [
        "",
        "| N | M | GETs per rank (max) | LISTs per rank | done records read per rank | GiB per rank "
        "| GETs + LISTs | GiB | duration s | SlowDowns | failed GETs | partitions at the end |",
        "|" + "---|" * 12,
    ]
    for p in sorted(rows, key=lambda p: p["n"]):
        for r in p["restore"]:
            x = r["model"]
            out.append(
                f"| {p['n']} | {r['m']} | {r['per_rank_gets']:,} | {r['per_rank_lists']} | {r['per_rank_records']} "
                f"| {r['per_rank_bytes'] / 2**30:.2f} | {r['gets'] + r['lists']:,} | {r['bytes'] / 2**30:.0f} "
                f"| {x['seconds']:.0f} | {x['slowdowns']:,} | {x['failed']:,} | {x['partitions']} |"
            )
    return out


def realistic_table(results: dict) -> str:
    """Markdown tables of the ``--realistic`` runs' saves and partition models, for SCALE.md."""

    def f(x, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x)

    out = [
        "| N | label | arrays | committed | failed ranks | commit latency s | all ranks know s | check CPU s "
        "| chain requests | requests/rank | protocol requests/rank | SlowDowns (per folder) "
        "| wait before first write s (median / max) | retention requests | retention s |",
        "|" + "---|" * 15,
    ]
    rows = [(s["n"], label, s) for label, res in results.items() for s in res.get("save", []) if s.get("realistic")]
    for n, label, s in sorted(rows, key=lambda r: (r[0], r[1])):
        out.append(
            f"| {n} | {label} | {s['arrays']} | {s['committed']} | {s['failed_ranks']} | {f(s['commit_latency_s'])} "
            f"| {f(s['all_know_s'])} | {f(s['check_cpu_s'], '{:.4f}')} | {s['chain_requests']} "
            f"| {s['requests_per_rank']:.1f} | {s['protocol_requests_per_rank']:.1f} | {s['slowdowns']} "
            f"| {f(s['claim_s_median'])} / {f(s['claim_s_max'])} | {s['retention_requests']} "
            f"| {f(s['retention_s'], '{:.1f}')} |"
        )
    out += partition_table(results)
    return "\n".join(out)


def table(results: dict) -> str:
    """Markdown tables of every label's figures, for SCALE.md."""

    def f(x, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x)

    out = [
        "| N | label | committed | failed ranks | commit latency s | all ranks know s | requests/save "
        "| per rank | PUT | GET | HEAD | LIST | peak PUT/s (prefix) | peak GET/s (prefix) | SlowDowns "
        "| claim requests | claims peak/s | claim s (median / max) |",
        "|" + "---|" * 18,
    ]
    rows = [(s["n"], label, s) for label, res in results.items() for s in res.get("save", [])]
    for n, label, s in sorted(rows, key=lambda r: (r[0], r[1] != "before")):
        q = s["requests"]
        out.append(
            f"| {n} | {label} | {s['committed']} | {s['failed_ranks']} | {f(s['commit_latency_s'])} "
            f"| {f(s['all_know_s'])} | {s['requests_total']} | {s['requests_per_rank']:.1f} | {q['PUT']} | {q['GET']} "
            f"| {q['HEAD']} | {q['LIST']} | {s['peak_put_per_s']} (`{s['peak_put_prefix']}`) "
            f"| {s['peak_get_per_s']} (`{s['peak_get_prefix']}`) | {s['slowdowns']} "
            f"| {s.get('claims_requests', '-')} | {s.get('claims_peak_per_s', '-')} "
            f"| {f(s.get('claim_s_median'))} / {f(s.get('claim_s_max'))} |"
        )
    out += ["", "| steps in the root | label | latest_step() requests | seconds |", "|---|---|---|---|"]
    rows = [(x["steps"], label, x) for label, res in results.items() for x in res.get("latest", [])]
    for n, label, x in sorted(rows, key=lambda r: (r[0], r[1] != "before")):
        out.append(f"| {n} | {label} | {x['requests']} | {x['seconds']:.3f} |")
    head = "| M | label | failed ranks | requests | per rank | seconds | peak GET/s | SlowDowns |"
    out += ["", head, "|" + "---|" * 8]
    rows = [(x["m"], label, x) for label, res in results.items() for x in res.get("restore", [])]
    for m, label, x in sorted(rows, key=lambda r: (r[0], r[1] != "before")):
        out.append(
            f"| {m} | {label} | {x.get('failed_ranks', 0)} | {x['requests']} | {x['requests_per_rank']:.2f} "
            f"| {x['seconds']:.3f} "
            f"| {x['peak_get_per_s']} | {x['slowdowns']} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    p.add_argument("--steps", default=",".join(map(str, STEPS)))
    p.add_argument("--latency", type=float, default=0.02, help="median seconds per request")
    p.add_argument("--sigma", type=float, default=0.3, help="log-normal shape of the latency")
    p.add_argument("--write-s", dest="write_s", type=float, default=10.0, help="mean upload time per rank")
    p.add_argument("--skew", type=float, default=0.03, help="relative spread of the upload times")
    p.add_argument("--straggle-s", dest="straggle_s", type=float, default=1.0)
    p.add_argument(
        "--start-s", dest="start_s", type=float, default=0.05, help="ranks start saving within this many seconds"
    )
    p.add_argument("--objects", type=int, default=2, help="data objects per rank")
    p.add_argument("--previous", type=int, default=3, help="checkpoints in the root before the save")
    p.add_argument("--keep-last", dest="keep_last", type=int, default=3)
    p.add_argument("--error-rate", dest="error_rate", type=float, default=0.0, help="injected 500s per request")
    p.add_argument("--lost-rate", dest="lost_rate", type=float, default=0.0, help="lost responses per request")
    p.add_argument(
        "--commit-timeout",
        dest="commit_timeout",
        type=float,
        default=3600.0,
        help="simulated seconds a rank waits for the commit (a save that cannot commit polls that long)",
    )
    p.add_argument(
        "--daemon",
        type=int,
        default=0,
        metavar="K",
        help="ranks persist through ckptd serve daemons of K ranks each (one claim per daemon); 0: in-process",
    )
    p.add_argument(
        "--realistic",
        action="store_true",
        help="manifests of --arrays arrays sharded over the ranks, real pool sizes, CPU charged (Realistic)",
    )
    p.add_argument("--arrays", type=int, default=1000, help="--realistic: arrays in the manifest")
    p.add_argument(
        "--cpu-scale", dest="cpu_scale", type=float, default=1.0, help="--realistic: CPU s charged per CPU s"
    )
    p.add_argument("--io-threads", dest="io_threads", type=int, default=16, help="--realistic: rank 0's I/O threads")
    p.add_argument(
        "--upload-workers", dest="upload_workers", type=int, default=2, help="--realistic: a daemon's upload_workers"
    )
    p.add_argument(
        "--full-previous-max",
        dest="full_previous_max",
        type=int,
        default=1_100_000,
        help="--realistic: the checkpoint retention deletes holds every rank's shards when N x arrays <= this",
    )
    p.add_argument(
        "--model-clients",
        dest="model_clients",
        type=int,
        default=256,
        help="partitions: model at most this many clients (identical ranks aggregated)",
    )
    p.add_argument("--label", default="after")
    p.add_argument("--only", choices=["save", "latest", "restore", "partitions"], action="append")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--plot", type=Path, nargs="?", const=HERE / "SCALE.png")
    p.add_argument("--table", action="store_true", help="print the markdown tables of --out and stop")
    p.add_argument("--wall-timeout", dest="wall_timeout", type=float, default=3600.0)
    args = p.parse_args(argv)
    COMMIT_TIMEOUT[0] = args.commit_timeout
    UPLOAD_WORKERS[0] = args.upload_workers if args.realistic else 10**9
    IO_THREADS[0] = args.io_threads if args.realistic else None
    sizes = [int(x) for x in args.sizes.split(",") if x]
    steps = [int(x) for x in args.steps.split(",") if x]
    only = set(args.only or (["save", "partitions"] if args.realistic else ["save", "latest", "restore"]))
    allres = json.loads(args.out.read_text()) if args.out.exists() else {}
    if args.table:
        print(realistic_table(allres) if args.realistic else table(allres))
        if args.plot:
            plot(allres, args.plot)
        return 0
    res = allres.setdefault(args.label, {})
    if "save" in only:
        res["save"] = []
        for n in sizes:
            r = simulate_save(n, args)
            res["save"].append(r)
            print(json.dumps(r), flush=True)
    if "latest" in only:
        res["latest"] = []
        for s in steps:
            r = simulate_latest(s, args)
            res["latest"].append(r)
            print(json.dumps(r), flush=True)
    if "restore" in only:
        res["restore"] = []
        for m in sizes:
            r = simulate_restore(m, args)
            res["restore"].append(r)
            print(json.dumps(r), flush=True)
    if "partitions" in only:
        res["partitions"] = []
        for n in sizes:
            r = simulate_partitions(n, args)
            res["partitions"].append(r)
            print(json.dumps(r), flush=True)
    # a partitions-only run keeps the settings of the label's save run
    res["settings_partitions" if only == {"partitions"} else "settings"] = {
        k: v for k, v in vars(args).items() if k not in ("out", "plot", "only")
    }
    args.out.write_text(json.dumps(allres, indent=1, default=str) + "\n")
    if args.plot:
        plot(allres, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
