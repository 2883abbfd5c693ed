"""The fault campaign: trainers, ``gc`` runs and daemons killed with SIGKILL at random points,
S3 requests failed through ``tests.doubles.faults.FaultProxy``, a disk that fills up; after
every event the job root is checked against the invariants of issue 14:

* every committed step is whole and unmixed: its manifest and its done records name the
  attempt its commit record names, and ``verify`` passes (every chunk present, crc32c ok);
* the newest committed step restores bitwise (the values are rebuilt from the step's seed);
* a failed save failed its future with one ``CheckpointError`` (the trainer logs it);
* after ``gc`` nothing is left but the kept steps and a partial newer than the newest commit (a
  save that may still be running: gc leaves those), no temp file, no incomplete upload;
* a slow writer (SIGSTOPped mid-save, or partitioned from S3 but for its data PUTs) whose step
  another writer took over after its lease is told its save failed, and its late writes leave
  the new commit whole (``slow_writer``, ``partition``).

``tests/faults/test_campaign.py`` runs a short campaign in CI; ``python -m benchmarks.faults``
the long one. Both count what happened in ``Campaign.counts``.
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ckptd import catalog, donetree
from ckptd import manifest as mf
from ckptd.cli import main as cli_main
from ckptd.verify import verify
from storage_backends import open_store
from tests import load
from tests.faults import workers


class InvariantError(AssertionError):
    pass


@dataclass
class Root:
    """A job root under test: its URI, the environment a process needs to reach it (through
    the fault proxy or not), and whether steps carry the multipart-sized tensor."""

    uri: str
    env: dict
    big: bool = False
    next_step: int = 1


class Pool:
    """A forkserver that imported torch and ``tests.faults.workers`` once; ``start`` forks a
    trainer from it (fast, and safe: the server has no threads)."""

    def __init__(self) -> None:
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(["tests.faults.workers"])

    def start(self, **kwargs) -> multiprocessing.Process:
        p = self.ctx.Process(target=workers.trainer, kwargs=kwargs, daemon=True)
        p.start()
        return p


def kill(p) -> None:
    """SIGKILL by pid (a Process or a Popen), then reap it."""
    pid = p.pid
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    if hasattr(p, "join"):
        p.join(30)
    else:
        p.wait(30)


def _progress(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except FileNotFoundError:
        return []


class Campaign:
    def __init__(self, work: Path, seed: int = 0) -> None:
        self.work = Path(work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.rng = random.Random(seed)
        self.counts: Counter[str] = Counter()
        self.pool = Pool()
        self.failures: list[str] = []  # one line per failed save, as the trainer saw it
        self._n = 0

    # ------------------------------------------------------------------ processes

    def _progress_file(self) -> Path:
        self._n += 1
        return self.work / f"progress-{self._n}.txt"

    def trainer(self, root: Root, count: int, **kw) -> tuple[multiprocessing.Process, Path]:
        prog = self._progress_file()
        env = {**root.env, **kw.pop("env", {})}
        p = self.pool.start(
            root=root.uri, first=root.next_step, count=count, progress=str(prog), env=env, big=root.big, **kw
        )
        return p, prog

    def run_trainer(self, root: Root, count: int, timeout: float = 300, **kw) -> list[str]:
        """A trainer that runs to its end; its progress lines."""
        p, prog = self.trainer(root, count, **kw)
        p.join(load.scaled(timeout))
        if p.is_alive():
            kill(p)
            raise InvariantError(
                f"a trainer saving {count} steps to {root.uri} did not finish in {load.scaled(timeout)} s"
            )
        lines = _progress(prog)
        self._account(root, lines)
        return lines

    def _account(self, root: Root, lines: list[str]) -> None:
        for line in lines:
            kind, _, rest = line.partition(" ")
            if kind == "ok":
                self.counts["saves committed"] += 1
            elif kind == "fail":
                self.counts["saves failed (one clear error)"] += 1
                step, _secs, msg = rest.split(" ", 2)
                self.failures.append(msg)
                if not msg or "\n" in msg:
                    raise InvariantError(f"a failed save gave no clear error: {line!r}")
        begun = [int(x.split()[1]) for x in lines if x.startswith("begin ")]
        if begun:
            root.next_step = max(root.next_step, max(begun) + 1)

    # ------------------------------------------------------------------ events

    def trainer_kill(self, root: Root, keep_last: int | None, window: tuple[float, float] = (0.2, 2.5)) -> None:
        """A trainer saving steps in a loop, SIGKILLed at a random moment of it."""
        p, prog = self.trainer(root, 50, keep_last=keep_last)
        # wait until it is really saving (forked, opened the store) before the clock starts
        deadline = load.deadline(120)
        while not _progress(prog) and p.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(self.rng.uniform(*window))
        kill(p)
        self._account(root, _progress(prog))
        self.counts["kills: trainer"] += 1
        self.counts[f"kills: trainer, {self._where_killed(root)}"] += 1
        self.check(root)

    def _where_killed(self, root: Root) -> str:
        """What the kill interrupted, as the root shows it: a save's writes (a partial newest
        step holding objects), or a moment with no partial step (between a commit and the next
        save's first write, or in retention)."""
        with _direct_env(root), open_store(root.uri) as store:
            infos = catalog.list_checkpoints(store)
        if infos and not infos[-1].committed:
            return "left a partial step (mid-write)"
        return "left no partial step (at or after a commit, retention)"

    def gc_kill(self, root: Root, cli_env: dict) -> None:
        """``ckptd gc`` (a real process) SIGKILLed at a random moment."""
        import subprocess
        import sys

        env = {**os.environ, **cli_env}
        p = subprocess.Popen(
            [sys.executable, "-m", "ckptd.cli.main", "gc", root.uri, "--keep-last", "1"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(self.rng.uniform(0.1, 1.2))
        killed = p.poll() is None
        kill(p)
        self.counts["kills: gc" if killed else "gc finished before its kill"] += 1
        self.check(root)

    def daemon_kill(self, root: Root, staging: Path, log: Path) -> None:
        """A trainer handing snapshots to a ``ckptd serve`` daemon; the daemon (and the
        trainer) SIGKILLed at a random moment; a new daemon on the same staging folder resumes
        what was journalled, then stops. Uploads are slowed a little so kills land mid-upload."""
        from tests.server.daemon import Daemon

        d = Daemon([root.uri], staging, log, upload_delay_s=0.05, **_daemon_env(root))
        d.start()
        try:
            p, prog = self.trainer(root, 50, daemon=d.socket_url)
            deadline = load.deadline(120)
            while not _progress(prog) and p.is_alive() and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(self.rng.uniform(0.2, 2.0))
            d.kill()
            kill(p)
            self.counts["kills: daemon"] += 1
            lines = _progress(prog)
            self._account(root, [x for x in lines if not x.startswith("fail")])  # a killed daemon fails the save
            self.counts["saves failed when their daemon was killed"] += sum(x.startswith("fail") for x in lines)
            d.start()  # the restart resumes or discards what the dead one had accepted
            settle = load.deadline(120)
            while time.monotonic() < settle:
                status, jobs = d.get("/v1/jobs?limit=4096")
                if status == 200 and all(j["state"] in ("committed", "failed", "discarded") for j in jobs):
                    break
                time.sleep(0.1)
            else:
                raise InvariantError(f"the restarted daemon never settled:\n{d.logs()}")
        finally:
            d.stop()
        self.check(root)

    def slow_writer(self, root: Root, same_id: bool, lease_s: float = 1.0) -> None:
        """A slow writer and a second writer of its step (issue 26 part 1), on a local root: A
        saves with a slow disk (each data file sits as a temp file before its link) and is
        SIGSTOPped mid-save (a GC pause, a frozen node: no heartbeat either); B -- another job,
        or the same job id restarted (``same_id``) -- saves the same step, which it gets once
        A's lease ran out (at once for the same id); then A is SIGCONTed and its late writes
        land. A's save must fail with one clear error and B's commit stay whole."""
        step = root.next_step
        a_env = {"TORCHELASTIC_RUN_ID": "campaign-slow-a", "CKPTD_CLAIM_LEASE_S": str(lease_s)}
        b_env = {**a_env, "TORCHELASTIC_RUN_ID": "campaign-slow-a" if same_id else "campaign-slow-b"}
        p, prog = self.trainer(root, 1, env=a_env, slow_rename_s=0.5)
        folder = Path(root.uri) / mf.step_dir(step)
        deadline = load.deadline(120)
        while not _has_temp_file(folder):
            if not p.is_alive() or time.monotonic() > deadline:
                raise InvariantError(f"the slow writer of step {step} never started writing")
            time.sleep(0.01)
        os.kill(p.pid, signal.SIGSTOP)
        try:
            self._save_when_free(root, step, b_env)
        finally:
            os.kill(p.pid, signal.SIGCONT)
        p.join(300)
        if p.is_alive():
            kill(p)
            raise InvariantError(f"the late writer of step {step} never finished")
        lines = _progress(prog)
        if not any(x.startswith(f"fail {step} ") for x in lines):
            raise InvariantError(f"the late writer of step {step} was told its save committed: {lines}")
        self._account(root, lines)
        self.counts["slow writers stopped, taken over, resumed" + (" (same job id)" if same_id else "")] += 1
        self.check(root)

    def partition(self, root: Root, lease_s: float = 1.0) -> None:
        """A writer cut off from S3 but for its data PUTs (issue 26 part 1): its own fault
        proxy holds every shard PUT until released and fails every lease renewal; another job
        takes the step over once the lease ran out and commits; then the held PUTs land."""
        from tests.doubles.faults import FaultPlan, FaultProxy, Rule

        step = root.next_step
        direct = root.env["CAMPAIGN_DIRECT_ENDPOINT"]
        plan = FaultPlan(
            rules=[
                Rule(lambda r: r.op == "PutObject" and "/arrays/" in r.path, "late", times=10**6),
                Rule(lambda r: "/alive/" in r.path, "500", times=10**6),
            ]
        )
        env = {"CKPTD_CLAIM_LEASE_S": str(lease_s), "CKPTD_S3_MAX_ATTEMPTS": "2"}
        with FaultProxy(direct, plan) as cut:
            a_env = {**env, "TORCHELASTIC_RUN_ID": "campaign-cut-a", "AWS_ENDPOINT_URL": cut.url}
            p, prog = self.trainer(root, 1, env=a_env)
            deadline = load.deadline(120)
            while cut.counters["fault:late"] < 1:
                if not p.is_alive() or time.monotonic() > deadline:
                    raise InvariantError(f"the partitioned writer of step {step} never sent a shard")
                time.sleep(0.01)
            try:
                self._save_when_free(root, step, {**env, "TORCHELASTIC_RUN_ID": "campaign-cut-b"})
            finally:
                cut.release_late()
            p.join(300)
            if p.is_alive():
                kill(p)
                raise InvariantError(f"the partitioned writer of step {step} never finished")
        lines = _progress(prog)
        if not any(x.startswith(f"fail {step} ") for x in lines):
            raise InvariantError(f"the partitioned writer of step {step} was told its save committed: {lines}")
        self._account(root, lines)
        self.counts["partitions: writer cut off, taken over, its PUTs landed late"] += 1
        self.check(root)

    def _save_when_free(self, root: Root, step: int, env: dict, tries: int = 200) -> None:
        """Another writer saves ``step`` (a trainer of one save per try) until it commits; its
        refusals while the first writer's lease lasts are expected, one clear error each."""
        for _ in range(tries):
            lines = self.run_trainer(Root(root.uri, root.env, root.big, step), 1, env=env)
            if any(x.startswith(f"ok {step} ") for x in lines):
                return
            time.sleep(0.2)
        raise InvariantError(f"{root.uri}: nobody could take step {step} over from a stopped writer")

    # ------------------------------------------------------------------ invariants

    def check(self, root: Root, *, gc: bool = True) -> int | None:
        """Check every invariant on ``root`` (through direct storage, never the proxy); with
        ``gc``, also run ``ckptd gc --keep-last 1`` and check what it left. Returns the newest
        committed step."""
        with _direct_env(root):
            store = open_store(root.uri)
            try:
                newest = self._check_committed(store, root)
                if gc:
                    self._gc_and_check(store, root)
            finally:
                store.close()
        self.counts["invariant checks passed"] += 1
        return newest

    def _check_committed(self, store, root: Root) -> int | None:
        committed = catalog.committed_steps(store)
        for s in committed:
            commit = catalog.read_commit(store, s)
            m = catalog.load_manifest(store, s)
            if m.attempt != commit.get("attempt"):
                raise InvariantError(f"{root.uri} step {s}: manifest of attempt {m.attempt}, commit {commit}")
            dones = donetree.count_done(store, s, m.attempt)
            if dones != commit.get("world_size"):
                raise InvariantError(f"{root.uri} step {s}: {dones} done records for {commit}")
            report = verify(store, s, threads=4)
            if not report.ok:
                raise InvariantError(f"{root.uri} step {s} committed but fails verify: {report.errors[:3]}")
            self.counts["committed steps verified"] += 1
        if not committed:
            return None
        newest = committed[-1]
        from trainer_hooks import Checkpointer

        state = workers.empty_state(root.big)
        with Checkpointer(root.uri) as ck:
            got = ck.restore(state)
        if got != newest or not workers.same_state(state, workers.campaign_state(newest, root.big)):
            raise InvariantError(f"{root.uri}: step {newest} does not restore bitwise (restored {got})")
        self.counts["bitwise restores"] += 1
        return newest

    def _gc_and_check(self, store, root: Root) -> None:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            rc = cli_main.main(["gc", root.uri, "--keep-last", "1", "--abort-uploads-older-than", "0", "--json"])
        if rc != 0:
            raise InvariantError(f"{root.uri}: gc exited {rc}: {out.getvalue()[-500:]}")
        doc = json.loads(out.getvalue())
        self.counts["gc runs"] += 1
        self.counts["gc: steps deleted"] += len(doc["deleted"])
        self.counts["gc: files deleted"] += doc["deleted_objects"]
        self.counts["gc: incomplete uploads / temp files removed"] += len(doc["aborted_uploads"])
        committed = catalog.committed_steps(store)
        newest = committed[-1] if committed else None
        for s in catalog.steps(store):
            if s in committed and s != newest and s not in doc["kept"]:
                raise InvariantError(f"{root.uri}: gc left committed step {s}")
            if s not in committed and newest is not None and s < newest:
                raise InvariantError(f"{root.uri}: gc left partial step {s} older than the newest commit {newest}")
        leftovers = _leftovers(store, root.uri, committed)
        if leftovers:
            raise InvariantError(f"{root.uri}: left behind after gc: {leftovers[:5]}")


def _has_temp_file(folder: Path) -> bool:
    try:
        return any(".tmp." in f.name for f in folder.rglob("*"))
    except OSError:  # a folder renamed or removed under the walk
        return False


def _daemon_env(root: Root) -> dict:
    """What a daemon process needs to reach ``root``: the proxy's endpoint, S3 tuning."""
    return {k: v for k, v in root.env.items() if k.startswith(("AWS_", "CKPTD_S3_"))}


@contextlib.contextmanager
def _direct_env(root: Root):
    """The environment of ``root`` minus the proxy: checks read storage as it really is."""
    direct = root.env.get("CAMPAIGN_DIRECT_ENDPOINT")
    saved = {k: os.environ.get(k) for k in root.env}
    os.environ.update(root.env)
    if direct:
        os.environ["AWS_ENDPOINT_URL"] = direct
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _leftovers(store, uri: str, committed: list[int]) -> list[str]:
    """Temp files inside committed steps (local roots), and incomplete uploads (S3)."""
    out = []
    if uri.startswith("s3://"):
        client = store._client
        for up in client.list_multipart_uploads(Bucket=store.bucket, Prefix=store._prefix).get("Uploads", []):
            out.append(f"upload {up['Key']}")
        return out
    rootp = Path(uri)
    for s in committed:
        for p in (rootp / mf.step_dir(s)).rglob("*"):
            if ".tmp." in p.name:
                out.append(str(p))
    return out
