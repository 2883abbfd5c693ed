"""The memory-only step campaign (issue 37 item 6): a job of ``RANKS`` gloo ranks on 2 nodes
(one ``ckptd serve`` each, as the docs run them: a token file, each node's socket, the ring's
peer key, ``--peers``) saves every step with ``persist_every=EVERY``; at a chosen point a
fault (``MODES``) hits it:

* ``node``: one node fails (SIGKILL of its daemon and its ranks; the job's other ranks go too);
  the job restores through the surviving daemon;
* ``all``: every daemon and rank is SIGKILLed; the job restores through a new daemon;
* ``restart`` / ``restart-spill``: daemon a is SIGKILLed with the job and restarted (on the same
  port and staging folder, with ``--spill-dir`` for the second), then node b fails; the job
  restores through the restarted a.

Each event restores at the job's world size and at half of it, and records the step restored
against the newest step whose save future had resolved on every rank before the kill
(``acked``; steps lost = acked - restored), a wrong restore (any key not bitwise equal to the
restored step's reference, or a step whose save had not begun), a hang (a restore past
``HANG_S``), the restore's time and its bytes from the job root. Delays come from the test
double ``tests.doubles.slow_serve`` (``--push-delay``: one step's pushes held in flight), never
from a product setting. A new mode (an erasure-coded ring) is one more entry in ``MODES``
(its daemons' flags and its kill) and in ``GOALS``.

``tests/faults/test_tier_campaign.py`` runs fixed kill points in CI; ``python -m
benchmarks.tier_campaign`` draws them uniformly in time.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests import load
from tests.distributed import launch
from tests.server.daemon import Daemon, kill_all, node, wait_for

SCENARIOS = "tests.faults.tier_scenarios"
TOKEN = "tier-campaign-token-0123456789"
MODES = ("node", "all", "restart", "restart-spill")
EVERY = 3  # persist_every: steps 3, 6, 9, ... reach the job root
RANKS = 2  # ranks of the job, split evenly over the 2 nodes
STEPS = 40  # steps the job would save if nothing killed it
PUSH_DELAY_S = 1.0  # the test double's hold on one step's pushes
HANG_S = 120.0  # a restore longer than this (scaled for the machine's load) is a hang


def goal(mode: str, acked: int, lost: int) -> bool | None:
    """Whether ``lost`` steps meet the mode's goal (None: no goal for this kill point). A single
    node lost (``node``; ``restart-spill``, whose restarted daemon re-adopts its spilled parts)
    loses at most 1 step once the first ``EVERY`` steps are acknowledged; losing every daemon's
    memory (``all``, ``restart`` without a spill folder) falls back to the newest persisted step
    acknowledged, never further."""
    if mode in ("node", "restart-spill"):
        return lost <= 1 if acked >= EVERY else None
    return lost <= acked % EVERY


@dataclass
class Outcome:
    mode: str
    after_step: int
    delay_s: float
    push_step: int | None
    acked: int = 0  # newest step resolved on every rank before the kill
    restored: list[int] = field(default_factory=list)  # per restore (world RANKS, then RANKS // 2)
    wrong: list[str] = field(default_factory=list)
    hang: bool = False
    restore_s: list[float] = field(default_factory=list)
    root_bytes: list[int] = field(default_factory=list)
    error: str = ""  # the harness failed (a daemon that did not start): not counted as a result

    @property
    def lost(self) -> int:
        return max((self.acked - r for r in self.restored), default=0)

    @property
    def met(self) -> bool | None:
        if self.error:
            return None
        if self.wrong or self.hang:
            return False
        return goal(self.mode, self.acked, self.lost)

    def line(self) -> str:
        return (
            f"{self.mode} after_step={self.after_step} delay={self.delay_s:.2f}s push_delay_step={self.push_step}: "
            f"acked {self.acked}, restored {self.restored}, lost {self.lost}, wrong {self.wrong}, hang {self.hang}, "
            f"restore {[round(s, 2) for s in self.restore_s]} s, root bytes {self.root_bytes}"
            + (f", harness error: {self.error[:300]}" if self.error else "")
        )


class TierCampaign:
    """Runs kill events under ``work`` (one folder each, removed after unless ``keep``)."""

    def __init__(self, work: Path, seed: int = 37, keep: bool = False):
        self.work, self.rng, self.keep = Path(work), random.Random(seed), keep
        self.work.mkdir(parents=True, exist_ok=True)
        self.n = 0

    def _nodes(self, d: Path, mode: str, push_step: int | None) -> tuple[str, list[Daemon], list[str]]:
        (d / "token").write_text(TOKEN)
        os.chmod(d / "token", 0o600)
        root = f"file://{d / 'job'}"
        ports = [launch.free_port(), launch.free_port()]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        daemons = []
        for i, name in enumerate("ab"):
            env = {}
            if mode == "restart-spill":
                (d / f"spill-{name}").mkdir(mode=0o700)
                env["CKPTD_SPILL_DIR"] = str(d / f"spill-{name}")
            push = (push_step, PUSH_DELAY_S) if push_step else None
            daemons.append(node(d, name, root, ports[i], urls, push_delay=push, **env))
        return root, daemons, urls

    def window(self) -> float:
        """Seconds from step 1's start to step ``2 * EVERY + 1``'s acknowledgement on every rank
        in an undisturbed run: the span the campaign draws its kill times over."""
        d = self.work / "window"
        d.mkdir(parents=True, exist_ok=True)
        root, (a, b), _ = self._nodes(d, "node", None)
        out = d / "out"
        procs = launch.spawn(
            RANKS, "save_steps", self._save_args(root, a, b, out), out, {"CKPTD_TOKEN": TOKEN}, SCENARIOS
        )
        try:
            wait_for(lambda: self._started(out), "the ranks to start", 300, procs, lambda: self._logs(out, a, b))
            t0 = time.monotonic()
            wait_for(lambda: self._acked(out) > 2 * EVERY, "the steps", 600, procs, lambda: self._logs(out, a, b))
            return time.monotonic() - t0
        finally:
            kill_all(procs)
            a.kill()
            b.kill()
            shutil.rmtree(d, ignore_errors=True)

    def random_event(self, mode: str, window: float) -> Outcome:
        """A kill at a time drawn uniformly over ``window`` after step 1 begins; half the events
        hold the pushes of a step drawn from the first ``2 * EVERY + 1`` in flight longer."""
        push = self.rng.randint(1, 2 * EVERY + 1) if self.rng.random() < 0.5 else None
        return self.event(mode, 0, round(self.rng.uniform(0, window), 3), push)

    def event(self, mode: str, after_step: int, delay_s: float = 0.0, push_step: int | None = None) -> Outcome:
        """One kill: once every rank acknowledged ``after_step`` (0: once step 1 began), wait
        ``delay_s``, then the fault of ``mode``; then the restores."""
        assert mode in MODES, mode
        self.n += 1
        d = self.work / f"{self.n:03d}-{mode}"
        d.mkdir(parents=True)
        res = Outcome(mode, after_step, delay_s, push_step)
        daemons: list[Daemon] = []
        procs = []
        try:
            root, daemons, urls = self._nodes(d, mode, push_step)
            a, b = daemons
            out = d / "out"
            args = self._save_args(root, a, b, out)
            procs = launch.spawn(RANKS, "save_steps", args, out, {"CKPTD_TOKEN": TOKEN}, SCENARIOS)
            logs = lambda: self._logs(out, a, b)  # noqa: E731
            wait_for(lambda: self._started(out) and self._acked(out) >= after_step, "the kill point", 600, procs, logs)
            time.sleep(delay_s)
            if mode == "node":
                b.kill()
                kill_all(procs[RANKS // 2 :])  # node b's ranks
                kill_all(procs)  # the job's other ranks go too
                via = a
            elif mode == "all":
                a.kill()
                b.kill()
                kill_all(procs)
                via = node(d, "c", root, launch.free_port(), [])  # a new node, no peers alive
                daemons.append(via)
            else:  # restart, restart-spill
                a.kill()
                kill_all(procs)
                a.start(port=a.port)
                b.kill()
                via = a
            res.acked = self._acked(out)
            for world in (RANKS, max(1, RANKS // 2)):
                rout = d / f"restore{world}"
                rargs = {"daemon": via.socket_url, "root": root, "refs": str(out), "saved_world": RANKS}
                rprocs = launch.spawn(world, "restore_step", rargs, rout, {"CKPTD_TOKEN": TOKEN}, SCENARIOS)
                try:
                    got = launch.wait(rprocs, rout, "restore_step", timeout=load.scaled(HANG_S))
                except AssertionError as e:
                    kill_all(rprocs)
                    if "timed out" in str(e):
                        res.hang = True
                        res.wrong.append(f"restore at {world} ranks timed out: {' '.join(str(e).split())[-300:]}")
                        break
                    raise
                steps = {r["step"] for r in got}
                if len(steps) != 1:
                    res.wrong.append(f"ranks restored different steps {sorted(steps)}")
                res.restored.append(min(steps))
                res.wrong += [f"{world} ranks, step {got[0]['step']}: {m}" for r in got for m in r["mismatches"]]
                res.restore_s.append(max(r["seconds"] for r in got))
                res.root_bytes.append(sum(r["tiers"].get("root", 0) for r in got))
        except AssertionError as e:
            res.error = " ".join(str(e).split())
        finally:
            kill_all(procs)
            for dm in daemons:
                dm.kill()
            if res.error or res.wrong or res.hang or res.met is False:
                for dm in daemons:  # keep the evidence next to the outcome
                    (d / f"{dm.log_path.stem}.tail").write_text(dm.logs())
            elif not self.keep:
                shutil.rmtree(d, ignore_errors=True)
        return res

    @staticmethod
    def _save_args(root: str, a: Daemon, b: Daemon, out: Path) -> dict:
        return {"daemons": [a.socket_url, b.socket_url], "root": root, "steps": STEPS, "persist_every": EVERY}

    @staticmethod
    def _started(out: Path) -> bool:
        return all((out / f"started_{r}").exists() for r in range(RANKS))

    @staticmethod
    def _acked(out: Path) -> int:
        """The newest step whose future resolved on every rank (0: none)."""
        done = []
        for r in range(RANKS):
            try:
                done.append(int((out / f"done_{r}").read_text()))
            except (OSError, ValueError):
                return 0
        return min(done)

    @staticmethod
    def _logs(out: Path, *daemons: Daemon) -> str:
        return launch.logs(out, "save_steps", RANKS) + "".join(
            f"\n--- {d.log_path.name} ---\n{d.logs()}" for d in daemons
        )
