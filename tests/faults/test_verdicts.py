"""Verdicts that cannot drive destructive operations, and a gc that never leaves a root without a
restorable step (issue 27 item 3; issue 26 part 2, bullets 3 and 4; issue 28 item 8).

Every attack is done for real on a local root: a writer that may put objects (overwrite
``_verify.json``, cut a shard, add a step folder) but holds no operator credentials; the
commands are real ``ckptd`` processes and the restores real ones. The ``job`` fixture (three committed steps)
is in ``tests/faults/conftest.py``."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest

from ckptd.errors import CheckpointError
from tests.faults.common import STEP_DIR, chunk_files, cli, flip_byte, make_state, same, truncate, values
from trainer_hooks import Checkpointer

pytestmark = pytest.mark.timeout(300)


def step_path(root: str, step: int) -> Path:
    return Path(root) / STEP_DIR.format(step)


def forge_verdict(root: str, step: int, ok: bool, errors: list[str] | None = None) -> None:
    """What an attacker who can read the step and put objects writes: a verdict made to match
    every binding a reader could check from the root's own bytes (the commit record's attempt and
    time, the digest of the commit record and manifest)."""
    folder = step_path(root, step)
    commit_bytes = (folder / "commit.json").read_bytes()
    manifest_bytes = (folder / "manifest.json").read_bytes()
    h = hashlib.sha256()
    for data in (commit_bytes, manifest_bytes):
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    commit = json.loads(commit_bytes)
    rec = {
        "step": step,
        "ok": ok,
        "judged": h.hexdigest(),
        "attempt": commit.get("attempt"),
        "commit_time": commit.get("time"),
        "time": 1.0e9,
        "arrays": 1,
        "objects": 1,
        "bytes": 1,
        "errors": [] if ok else (errors or ["forged"]),
    }
    (folder / "_verify.json").write_text(json.dumps(rec))


def committed(root: str) -> list[int]:
    return sorted(int(p.parent.name[5:]) for p in Path(root).glob("step_*/commit.json"))


def test_gc_without_any_verify_keeps_the_newest_restorable_step(job):
    """Issue 26: with no prior ``verify --all``, ``gc --keep-last 1`` kept a corrupt newest step
    and deleted the last good one."""
    root, saved = job
    truncate(chunk_files(root, 3)[0], 10)  # a shard cut short: lost writes, a bad disk
    out = cli("gc", root, "--keep-last", "1")
    assert out.returncode == 0, out.stderr
    assert committed(root) == [2, 3]
    assert "step_0000000003 fails the restorability check" in out.stderr
    assert "keeping step_0000000002" in out.stderr
    with Checkpointer(root) as ck:
        state = make_state(seed=50)
        assert ck.restore(state, fallback=True) == 2
        assert same(values(state), saved[2])
    # once a newer good step exists, the old anchor goes as usual
    with Checkpointer(root) as ck:
        ck.save(4, make_state(seed=4)).result()
    out = cli("gc", root, "--keep-last", "1", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["deleted"] == [2, 3]
    assert committed(root) == [4]


def test_a_forged_ok_on_a_corrupt_step_does_not_make_gc_delete_the_good_one(job):
    """Issue 27 item 3: a forged "ok" on the corrupt newest step (overwriting the "bad" that
    ``verify --all`` recorded) made ``gc --keep-last 1`` delete every good step."""
    root, saved = job
    truncate(chunk_files(root, 3)[0], 10)
    out = cli("verify", root, "--all")
    assert out.returncode == 1 and "step_0000000003" in out.stdout + out.stderr
    forge_verdict(root, 3, ok=True)  # matches every binding: the attacker can read the root
    out = cli("gc", root, "--keep-last", "1")
    assert out.returncode == 0, out.stderr
    assert 2 in committed(root), out.stdout + out.stderr
    with Checkpointer(root) as ck:
        state = make_state(seed=51)
        assert ck.restore(state, fallback=True) == 2
        assert same(values(state), saved[2])


def test_forged_verdicts_only_ever_make_gc_keep_more(job, tmp_path):
    """Whatever verdicts an attacker writes on every step, gc deletes a subset of what it
    deletes with no verdict at all."""
    root, _ = job
    flip_byte(chunk_files(root, 3)[0])  # a byte flipped: only ``verify`` sees it
    baseline = tmp_path / "baseline"
    shutil.copytree(root, baseline)
    out = cli("gc", baseline, "--keep-last", "1", "--dry-run", "--json")
    assert out.returncode == 0, out.stderr
    without = set(json.loads(out.stdout)["deleted"])
    for oks in ((True, True, True), (False, False, False), (True, False, True), (False, True, False)):
        for step, ok in zip((1, 2, 3), oks, strict=True):
            forge_verdict(root, step, ok)
        out = cli("gc", root, "--keep-last", "1", "--dry-run", "--json")
        assert out.returncode == 0, out.stderr
        assert set(json.loads(out.stdout)["deleted"]) <= without, oks


@pytest.mark.parametrize(
    "record",
    [
        {"step": 3, "ok": False},  # no errors: KeyError in restore(fallback=True) before
        {"step": 3, "ok": False, "errors": 5},  # TypeError before
        {"step": 3, "ok": False, "errors": [{"x": 1}]},
        {"step": 3, "ok": "no", "errors": []},
        ["not", "an", "object"],
        "just a string",
    ],
    ids=["no-errors", "errors-int", "errors-objects", "ok-string", "list", "string"],
)
def test_malformed_verdicts_are_ignored_with_one_warning(job, record, caplog):
    root, saved = job
    commit = json.loads((step_path(root, 3) / "commit.json").read_text())
    if isinstance(record, dict):  # the bindings the previous reader checked, copied, and a digest
        record = record | {"attempt": commit["attempt"], "commit_time": commit["time"], "judged": "0" * 64}
    (step_path(root, 3) / "_verify.json").write_text(json.dumps(record))
    with Checkpointer(root) as ck, caplog.at_level(logging.WARNING, logger="ckptd.verify"):
        for seed in (60, 61):  # twice: still one warning
            state = make_state(seed=seed)
            assert ck.restore(state, fallback=True) == 3
            assert same(values(state), saved[3])
            assert ck.last_restore_skipped == []
    warned = [r for r in caplog.records if "ignoring the verify record" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    out = cli("ls", root, "--json")
    assert out.returncode == 0, out.stderr
    assert [r["verified"] for r in json.loads(out.stdout)] == ["unverified"] * 3
    out = cli("gc", root, "--keep-last", "1", "--json")
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert committed(root) == [3]


def test_a_verdict_is_bound_to_the_bytes_it_judged(job):
    root, saved = job
    # a record of the format before the binding (attempt and commit time only): unverified
    commit = json.loads((step_path(root, 3) / "commit.json").read_text())
    legacy = {"step": 3, "ok": False, "attempt": commit["attempt"], "commit_time": commit["time"], "time": 1.0e9}
    (step_path(root, 3) / "_verify.json").write_text(json.dumps(legacy | {"arrays": 1, "objects": 1, "bytes": 1}))
    rows = {r["step"]: r["verified"] for r in json.loads(cli("ls", root, "--json").stdout)}
    assert rows[3] == "unverified"
    out = cli("verify", root, "--all")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {r["step"]: r["verified"] for r in json.loads(cli("ls", root, "--json").stdout)}
    assert rows == {1: "ok", 2: "ok", 3: "ok"}
    # step 2's "bad" copied onto step 3: it judged other bytes
    flip_byte(chunk_files(root, 2)[0])
    assert cli("verify", root, "--step", "2", "--record").returncode == 1
    shutil.copy(step_path(root, 2) / "_verify.json", step_path(root, 3) / "_verify.json")
    rec = json.loads((step_path(root, 3) / "_verify.json").read_text())
    rec["step"] = 3
    (step_path(root, 3) / "_verify.json").write_text(json.dumps(rec))
    rows = {r["step"]: r["verified"] for r in json.loads(cli("ls", root, "--json").stdout)}
    assert rows[3] == "unverified" and rows[2] == "bad"
    with Checkpointer(root) as ck:
        state = make_state(seed=70)
        assert ck.restore(state, fallback=True) == 3  # not rolled back by the copied verdict
        assert same(values(state), saved[3])
    # step 1's manifest rewritten (same commit record, same attempt and time): its "ok" is void
    m = step_path(root, 1) / "manifest.json"
    m.write_text(json.dumps(json.loads(m.read_text()), indent=1))
    rows = {r["step"]: r["verified"] for r in json.loads(cli("ls", root, "--json").stdout)}
    assert rows[1] == "unverified"


def test_a_step_far_past_the_newest_is_refused_at_save_and_ignored_by_gc(job, monkeypatch):
    root, _ = job
    with Checkpointer(root) as ck:
        assert ck.restore(make_state(seed=80)) == 3
        with pytest.raises(CheckpointError, match=r"step 9999999999 is 9999999996 steps past .*max_step_jump=1000000"):
            ck.save(9_999_999_999, make_state(seed=81))
        ck.save(4, make_state(seed=4)).result()  # a step within the bound still saves
    monkeypatch.setenv("CKPTD_MAX_STEP_JUMP", "0")  # no bound: the operator's choice
    with Checkpointer(root) as ck:
        assert ck.restore(make_state(seed=82)) == 4
        assert ck.max_step_jump is None
    monkeypatch.delenv("CKPTD_MAX_STEP_JUMP")

    # a put-only writer copies a whole step folder to step 9999999999, commit record and all
    shutil.copytree(step_path(root, 4), step_path(root, 9_999_999_999))
    out = cli("gc", root, "--keep-last", "1", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["out_of_nowhere"] == [9_999_999_999]
    assert committed(root) == [4, 9_999_999_999], doc  # 4 is not pushed out by the forged step
    assert "jumped more than 1000000" in out.stderr


def test_unquarantine_refuses_when_the_step_was_saved_again_and_gcd(job):
    """Issue 28 item 8: the quarantined corrupt copy came back as committed after the step's
    re-save was removed by gc."""
    root, _ = job
    flip_byte(chunk_files(root, 3)[0])
    assert cli("verify", root, "--all").returncode == 1
    assert cli("quarantine", root, "--step", "3", "--reason", "crc32c").returncode == 0
    with Checkpointer(root) as ck:
        assert ck.restore(make_state(seed=90)) == 2
        for step in (3, 4, 5):
            ck.save(step, make_state(seed=100 + step)).result()
    assert cli("gc", root, "--keep-last", "1").returncode == 0
    assert committed(root) == [2, 5]  # 2: the newest step verify recorded ok
    out = cli("unquarantine", root, "--step", "3")
    assert out.returncode == 1, out.stdout
    assert "saved again since" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert committed(root) == [2, 5]
    # forced, it comes back with its verdict: bad, and fallback skips it
    out = cli("unquarantine", root, "--step", "3", "--force")
    assert out.returncode == 0, out.stderr
    assert "verified: bad" in out.stdout
    rows = {r["step"]: r["verified"] for r in json.loads(cli("ls", root, "--json").stdout)}
    assert rows[3] == "bad"


def test_two_ranks_fall_back_past_recorded_and_malformed_verdicts_in_step(tmp_path):
    """Fallback reads each step's verdict on rank 0 when its turn comes; both ranks make the same
    collectives and land on the same step."""
    import sys

    from tests.local_launch import log_tails, spawn_ranks, wait_ranks

    root = str(tmp_path / "job")
    repo = Path(__file__).resolve().parents[2]

    def run(phase: str) -> None:
        logs = lambda r: tmp_path / f"{phase}{r}.log"  # noqa: E731
        procs = spawn_ranks(
            2,
            [sys.executable, "-m", "tests.faults.fallback_ranks", phase, root, str(tmp_path)],
            logs,
            cwd=repo,
            pythonpath=repo,
        )
        assert wait_ranks(procs, 240) == [0, 0], log_tails(logs, 2)

    run("save")
    flip_byte(chunk_files(root, 3)[0])
    assert cli("verify", root, "--all").returncode == 1  # records 3 bad
    (step_path(root, 2) / "_verify.json").write_text(json.dumps({"step": 2, "ok": False}))  # malformed
    run("restore")
    docs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert docs[0] == docs[1] == {"step": 2, "w": 2.0, "skipped": [3]}
