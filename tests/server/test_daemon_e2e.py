"""End to end with real processes: trainer ranks (gloo) hand snapshots to real ``ckptd serve``
daemons; ranks and daemons are killed with SIGKILL at the worst moments."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from ckptd import catalog
from storage_backends import open_store
from tests.distributed import launch
from tests.server import daemon as dm
from tests.server.daemon import Daemon, wait_for
from trainer_hooks import Checkpointer

pytestmark = pytest.mark.slow


def ckptd(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptd.cli.main", *args], capture_output=True, text=True)


@pytest.fixture
def shm_staging():
    """A staging folder in /dev/shm, as in production (unique: other test runs share the machine)."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    if base is None:
        pytest.skip("no /dev/shm")
    folder = base / f"ckptd-test-{uuid.uuid4().hex[:12]}"
    yield folder
    import shutil

    shutil.rmtree(folder, ignore_errors=True)


def _restore_here(root: str, ref: Path, step: int) -> list[str]:
    """Restore ``step`` in this process (world size 1) and list tensors that differ from ``ref``."""
    from tests.distributed.scenarios import full_state, make_state

    state, _, _ = make_state("single", 123)
    with Checkpointer(root) as ck:
        assert ck.restore(state, step=step) == step
    got, expect = full_state(state), torch.load(ref)
    assert set(got) == set(expect), sorted(set(got) ^ set(expect))
    return [k for k in expect if expect[k].dtype != got[k].dtype or not torch.equal(expect[k], got[k])]


def _save_hang_kill(tmp_path: Path, daemons: list[Daemon], root: str, world: int = 2) -> None:
    """Ranks save through the daemons and are SIGKILLed the moment every save has returned."""
    dm.kill_all(dm.saves_returned(daemons, root, tmp_path, world))


@pytest.mark.timeout(300)
def test_ranks_killed_after_save_still_commit_and_restore_at_3(tmp_path, shm_staging):
    root = str(tmp_path / "job")
    # Uploads slowed a little, so the trainers are certainly dead before the commit.
    with Daemon([root], shm_staging, tmp_path / "daemon.log", upload_delay_s=0.5) as d:
        _save_hang_kill(tmp_path, [d], root)
        store = open_store(root)
        assert catalog.read_commit(store, 1) is None, "committed before the trainers died: the test proves nothing"
        wait_for(lambda: catalog.read_commit(store, 1) is not None, "the commit", 120, logs=d.logs)
        # both ranks' jobs see it (the one that did not commit notices through its watcher)
        wait_for(lambda: d.metric("ckptd_jobs_committed_total") == 2, "both jobs committed", 30, logs=d.logs)
    res = launch.run(3, "restore", tmp_path, layout="fsdp", root=root, ref="ref_fsdp_2.pt")
    assert res[0]["step"] == 1
    assert res[0]["mismatches"] == [], res[0]["mismatches"]
    assert len({r["next_loss"] for r in res}) == 1
    v = ckptd("verify", root)
    assert v.returncode == 0, v.stderr


@pytest.mark.timeout(300)
def test_daemon_killed_mid_upload_then_restarted(tmp_path):
    root = str(tmp_path / "job")
    staging = tmp_path / "staging"
    d = Daemon([root], staging, tmp_path / "d1.log", upload_delay_s=1.0).start()
    d2 = None
    procs = dm.spawn(1, "save_across_daemon_crash", {"daemon": d.socket_url, "root": root}, tmp_path)
    logs = lambda: launch.logs(tmp_path, "save_across_daemon_crash", 1) + d.logs()  # noqa: E731
    try:
        store = open_store(root)
        wait_for(lambda: (tmp_path / "save2_returned").exists(), "save of step 2", 180, procs, logs)
        wait_for(
            lambda: any(True for _ in store.list("step_0000000002/arrays/")),
            "step 2's upload to start",
            60,
            procs,
            logs,
        )
        d.kill()
        assert catalog.read_commit(store, 2) is None  # killed mid-upload: partial, never committed
        assert catalog.latest_step(store) == 1
        d2 = Daemon([root], staging, tmp_path / "d2.log").start(port=d.port)
        res = launch.wait(procs, tmp_path, "save_across_daemon_crash", timeout=180)[0]
        assert res["step2"] == "committed", res  # its files were intact: the restart finished it
        assert "resuming job" in d2.logs()
        assert d2.metric("ckptd_jobs_recovered_total") == 1
    finally:
        dm.kill_all(procs)
        d.kill()
        if d2 is not None:
            d2.stop()
    assert catalog.committed_steps(store) == [1, 2, 3]
    v = ckptd("verify", root, "--step", "2")
    assert v.returncode == 0, v.stderr
    assert _restore_here(root, tmp_path / "ref_step1.pt", 1) == []  # the previous step still restores
    assert _restore_here(root, tmp_path / "ref_step3.pt", 3) == []


@pytest.mark.timeout(300)
def test_two_daemons_as_two_nodes_commit_once(tmp_path):
    root = str(tmp_path / "job")
    with (
        Daemon([root], tmp_path / "node0", tmp_path / "node0.log") as d0,
        Daemon([root], tmp_path / "node1", tmp_path / "node1.log") as d1,
    ):
        res = dm.run(2, "save_and_wait", tmp_path, daemons=[d0.socket_url, d1.socket_url], root=root)
        assert sum(r["committed_here"] for r in res) == 1  # exactly one rank's daemon committed
        assert d0.metric("ckptd_commits_written_total") + d1.metric("ckptd_commits_written_total") == 1
        assert d0.metric("ckptd_jobs_committed_total") == d1.metric("ckptd_jobs_committed_total") == 1
    store = open_store(root)
    commit = catalog.read_commit(store, 1)
    assert commit["world_size"] == 2
    assert len(list(store.list(f"step_0000000001/_done/{commit['attempt']}/"))) == 2
    assert _restore_here(root, tmp_path / "ref_fsdp_2.pt", 1) == []


@pytest.mark.timeout(300)
def test_budget_smaller_than_two_snapshots_makes_the_second_save_wait(tmp_path):
    root = str(tmp_path / "jobs")
    # one snapshot is 256 KiB + a little: the budget holds one, not two
    with Daemon(
        [root],
        tmp_path / "staging",
        tmp_path / "daemon.log",
        CKPTD_BUDGET=str(400 * 1024),
        upload_delay_s=2.0,
    ) as d:
        a = dm.spawn(1, "save_big", {"daemon": d.socket_url, "root": root + "/a", "tag": "a"}, tmp_path / "a")
        b = dm.spawn(
            1,
            "save_big",
            {"daemon": d.socket_url, "root": root + "/b", "tag": "b", "wait_for": str(tmp_path / "a" / "returned_a")},
            tmp_path / "b",
        )
        ra = launch.wait(a, tmp_path / "a", "save_big", timeout=180)[0]
        rb = launch.wait(b, tmp_path / "b", "save_big", timeout=180)[0]
        assert d.metric("ckptd_budget_waits_total") > 0
        # both ranks' jobs see it (the one that did not commit notices through its watcher)
        wait_for(lambda: d.metric("ckptd_jobs_committed_total") == 2, "both jobs committed", 30, logs=d.logs)
    assert rb["blocked_s"] > max(0.5, ra["blocked_s"]), (ra, rb)  # b waited for a's upload to free memory
    assert "waits for staging memory" in (tmp_path / "b" / "save_big.rank0.log").read_text()
    for job in ("a", "b"):
        assert catalog.latest_step(open_store(f"{root}/{job}")) == 1


@pytest.mark.s3
@pytest.mark.timeout(300)
def test_s3_root_end_to_end(tmp_path, s3_bucket):
    root = s3_bucket
    with Daemon([root], tmp_path / "staging", tmp_path / "daemon.log", upload_delay_s=0.5) as d:
        _save_hang_kill(tmp_path, [d], root)
        store = open_store(root)
        assert catalog.read_commit(store, 1) is None
        wait_for(lambda: catalog.read_commit(store, 1) is not None, "the commit", 120, logs=d.logs)
        out = ckptd("ls", root, "--json")
        assert out.returncode == 0, out.stderr
        assert [r["committed"] for r in json.loads(out.stdout)] == [True]
    assert _restore_here(root, tmp_path / "ref_fsdp_2.pt", 1) == []


@pytest.mark.timeout(180)
def test_unchanged_metadata_stays_staged_and_a_planted_link_is_replaced(tmp_path):
    """A save through the daemon leaves the metadata files of the previous save in the lease when
    their bytes are unchanged (each array's zarr.json: no rewrite per save), but only if each is
    still the very file it wrote: one replaced by a link to a secret file between saves is
    unlinked and written again, so the save commits and the secret goes nowhere."""
    root = str(tmp_path / "jobs")
    staging = tmp_path / "staging"
    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET-" * 64)
    state = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(64)}
    with Daemon([root], staging, tmp_path / "daemon.log") as d, Checkpointer(root, daemon=d.socket_url) as ck:

        def staged() -> dict[Path, tuple[bytes, int]]:
            return {p: (p.read_bytes(), p.stat().st_ino) for p in staging.rglob("meta_*.bin")}

        ck.save(1, state).result()
        first = staged()
        state["w"] += 1
        ck.save(2, state).result()
        second = staged()
        kept = [p for p in first if p in second and first[p][0] == second[p][0]]
        assert kept, "no metadata file kept its bytes between saves"
        assert all(first[p][1] == second[p][1] for p in kept), "unchanged metadata files were rewritten"
        target = kept[0]
        want = target.read_bytes()
        target.unlink()
        target.symlink_to(secret)
        state["w"] += 1
        ck.save(3, state).result()
        assert not target.is_symlink() and target.read_bytes() == want
    store = open_store(root)
    assert catalog.latest_step(store) == 3
    leaked = [o.key for o in store.list("") if b"SECRET-" in store.get(o.key)]
    assert leaked == []


def test_metadata_over_16_mib_goes_through_the_daemon(tmp_path):
    """A job's metadata may be up to handoff.MAX_META_BYTES (a manifest of a state with a large
    plain object): the daemon that accepted it must also be able to read it back for the upload
    (the hand-off used to be read with the 16 MiB cap of lease journals, and the save failed)."""
    root = str(tmp_path / "jobs")
    blob = "x" * (20 << 20)
    state = {"w": torch.arange(64, dtype=torch.float32), "cfg": {"vocab": blob}}
    with (
        Daemon([root], tmp_path / "staging", tmp_path / "daemon.log") as d,
        Checkpointer(root, daemon=d.socket_url) as ck,
    ):
        ck.save(1, state).result()
    got = {"w": torch.zeros(64), "cfg": {}}
    with Checkpointer(root) as ck:
        assert ck.restore(got) == 1
    assert got["cfg"]["vocab"] == blob and torch.equal(got["w"], state["w"])
