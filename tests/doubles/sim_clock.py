"""Simulated time for the simulated S3: many threads, one running at a time, a clock that jumps.

Each simulated rank is a thread, but the clock lets exactly one of them run at a time and jumps
to the next wake-up when the running one sleeps, so 8192 ranks waiting 20 ms each cost no wall
time, and a run is deterministic for a seed (wake-ups at one instant run in the order they were
scheduled).

Invariants: a thread gives up its turn only by sleeping on the clock (``VirtualClock.sleep``)
or waiting on a ``VirtualEvent``. So code under simulation must block only through the store or
the clock (``clock.sleep``/``clock.time``, or a ``VirtualTime`` standing in for its ``time``
module); a thread that waits on anything else (a lock another simulated thread holds across a
request, a future of an unregistered pool) stalls the simulation, which ``VirtualClock.run``
reports (``SimulationStalled``) after a wall-clock timeout instead of hanging.

No store here: ``tests.doubles.simulated`` sleeps its requests on this clock.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Sequence

__all__ = ["SimulationStalled", "VirtualClock", "VirtualEvent", "VirtualTime"]


class SimulationStalled(RuntimeError):
    """No simulated thread can run and some have not finished: one waits outside the clock."""


class VirtualClock:
    """Simulated time for threads: one registered thread runs at a time; ``sleep`` yields.

    ``spawn`` registers threads (from the driver before ``run``, or from a simulated thread);
    ``run`` starts the simulation and returns when every registered thread has finished,
    re-raising the first exception one of them raised. Threads wake in (time, registration
    order), so a run with seeded randomness is deterministic.
    """

    def __init__(self, stack_size: int = 512 * 1024, cpu_scale: float = 0.0) -> None:
        self.now = 0.0
        # cpu_scale > 0: the CPU time a simulated thread spends between two yields (measured with
        # time.thread_time, so other threads and processes on the machine do not inflate it) is
        # charged to its virtual time, times cpu_scale, before it sleeps or waits: the checks of
        # the code under test then take simulated time in proportion to what they cost here.
        self.cpu_scale = cpu_scale
        self.cpu_charged = 0.0  # simulated seconds charged for CPU, over all threads
        self._heap: list[tuple[float, int, threading.Lock]] = []
        self._seq = itertools.count()
        self._tls = threading.local()
        self._pending: list[threading.Thread] = []
        self._alive = 0
        self._done = threading.Event()
        self._errors: list[BaseException] = []
        self._guard = threading.Lock()  # only for the bookkeeping done by the driver thread
        self._stack_size = stack_size

    def time(self) -> float:
        return self.now

    def in_simulation(self) -> bool:
        return getattr(self._tls, "lock", None) is not None

    def spawn(self, fn: Callable[[], object], at: float | None = None, name: str = "sim") -> None:
        """Run ``fn`` in a new simulated thread from virtual time ``at`` (default: now)."""
        lock = threading.Lock()
        lock.acquire()

        def body() -> None:
            lock.acquire()  # our first turn
            self._tls.lock = lock
            self._tls.cpu = time.thread_time()
            try:
                fn()
            except BaseException as e:  # handed to run()
                self._errors.append(e)
            finally:
                self._alive -= 1
                self._tls.lock = None
                self._next()

        old = threading.stack_size()
        threading.stack_size(self._stack_size)
        try:
            t = threading.Thread(target=body, name=name, daemon=True)
        finally:
            threading.stack_size(old)
        self._alive += 1
        heapq.heappush(self._heap, (self.now if at is None else max(at, self.now), next(self._seq), lock))
        t.start()

    def sleep(self, seconds: float) -> None:
        """Let simulated time pass for this thread (a real short sleep outside a simulation)."""
        lock = getattr(self._tls, "lock", None)
        if lock is None:
            raise RuntimeError("VirtualClock.sleep called from a thread the clock did not spawn")
        heapq.heappush(self._heap, (self.now + max(0.0, seconds) + self._cpu(), next(self._seq), lock))
        self._next()
        lock.acquire()
        self._tls.cpu = time.thread_time()

    def _cpu(self) -> float:
        """The CPU this thread used since its turn began, scaled (0 without ``cpu_scale``)."""
        if self.cpu_scale <= 0:
            return 0.0
        used = max(0.0, time.thread_time() - getattr(self._tls, "cpu", time.thread_time())) * self.cpu_scale
        self.cpu_charged += used
        return used

    def wait(self, event: VirtualEvent) -> None:
        """Suspend this simulated thread until ``event`` is set (at once if it is)."""
        if self.cpu_scale > 0 and self.in_simulation():
            self.sleep(0.0)  # its CPU so far first
        if event.is_set:
            return
        lock = getattr(self._tls, "lock", None)
        if lock is None:
            raise RuntimeError("VirtualClock.wait called from a thread the clock did not spawn")
        event._waiters.append(lock)
        self._next()
        lock.acquire()
        self._tls.cpu = time.thread_time()

    def run_jobs(self, jobs: Sequence[Callable[[], object]], workers: int, name: str = "sim") -> None:
        """Run ``jobs`` in order on ``workers`` threads of this clock and wait for them all (from
        a simulated thread). The first failure stops the jobs not yet started and is raised
        here, once every worker has finished."""
        todo: list[Callable[[], object]] = list(reversed(jobs))
        errors: list[BaseException] = []
        if not todo:
            return
        done, running = VirtualEvent(self), [min(max(1, workers), len(todo))]

        def worker() -> None:
            try:
                while todo and not errors:
                    todo.pop()()
            except BaseException as e:  # handed to the waiting thread
                errors.append(e)
            finally:
                running[0] -= 1
                if running[0] == 0:
                    done.set()

        for _ in range(running[0]):
            self.spawn(worker, name=name)
        self.wait(done)
        if errors:
            raise errors[0]

    def _next(self) -> None:
        if self._heap:
            t, _, lock = heapq.heappop(self._heap)
            self.now = max(self.now, t)
            lock.release()
        elif self._alive == 0:
            self._done.set()
        else:  # threads left, none scheduled: one blocks outside the clock
            self._errors.append(SimulationStalled(f"{self._alive} simulated threads blocked outside the clock"))
            self._done.set()

    def run(self, timeout: float = 600.0) -> float:
        """Run until every spawned thread finished; returns the virtual time at the end."""
        if self._alive == 0:
            return self.now
        self._done.clear()
        self._next()
        if not self._done.wait(timeout):
            raise SimulationStalled(f"simulation did not finish in {timeout} s of wall time")
        if self._errors:
            raise self._errors[0]
        return self.now


class VirtualEvent:
    """A one-shot event for simulated threads: ``clock.wait(event)`` suspends a thread without
    occupying the clock's schedule until another simulated thread calls ``set`` (no polling, so a
    task pool of simulated threads costs no wake-ups while it waits)."""

    def __init__(self, clock: VirtualClock) -> None:
        self._clock = clock
        self.is_set = False
        self._waiters: list[threading.Lock] = []

    def set(self) -> None:
        """Wake every waiter at the current virtual time (call it from a simulated thread)."""
        self.is_set = True
        for lock in self._waiters:
            heapq.heappush(self._clock._heap, (self._clock.now, next(self._clock._seq), lock))
        self._waiters.clear()


class VirtualTime:
    """A stand-in for the ``time`` module that reads and sleeps on a :class:`VirtualClock`;
    a simulation puts it in place of the ``time`` of the modules it runs (``mod.time = ...``),
    so their polling pauses and deadlines pass in simulated seconds."""

    def __init__(self, clock: VirtualClock, epoch: float = 1.7e9) -> None:
        self._clock, self._epoch = clock, epoch

    def time(self) -> float:
        return self._epoch + self._clock.time()

    def monotonic(self) -> float:
        return self._clock.time()

    perf_counter = monotonic

    def sleep(self, seconds: float) -> None:
        self._clock.sleep(seconds)

    def __getattr__(self, name: str):
        return getattr(time, name)
