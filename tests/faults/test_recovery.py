"""A corrupt latest checkpoint: fallback restore, recorded verdicts, gc that keeps the newest
verified step, quarantine (issue 14, item 5), and what in_place restore says (item 7).

The damage is real: bytes flipped in a chunk file on disk, a manifest cut short; the commands are
real ``ckptd`` processes. The ``job`` fixture (three committed steps)
is in ``tests/faults/conftest.py``."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import pytest

from ckptd.errors import CheckpointError, CorruptChunkError
from tests.faults.common import STEP_DIR, chunk_files, cli, flip_byte, make_state, same, truncate, values
from trainer_hooks import Checkpointer, CheckpointHook

pytestmark = pytest.mark.timeout(300)


def commit_digests(root: str) -> dict[str, str]:
    return {
        p.parent.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(root).glob("step_*/commit.json"))
    }


def test_fallback_restores_the_newest_step_that_passes_and_says_what_it_skipped(job, caplog):
    root, saved = job
    flip_byte(chunk_files(root, 3)[0])
    with Checkpointer(root) as ck:
        with pytest.raises(CorruptChunkError, match="crc32c"):
            ck.restore(make_state(seed=99))
        state = make_state(seed=99)
        with caplog.at_level(logging.WARNING, logger="ckptd.restore"):
            assert ck.restore(state, fallback=True) == 2
        assert same(values(state), saved[2])
        assert [s for s, _ in ck.last_restore_skipped] == [3]
        assert "crc32c" in ck.last_restore_skipped[0][1]
        assert any("skipping step 3" in r.getMessage() and "crc32c" in r.getMessage() for r in caplog.records)

        # a manifest cut short on step 2 as well: back to step 1
        truncate(Path(root) / STEP_DIR.format(2) / "manifest.json", 40)
        state = make_state(seed=98)
        assert ck.restore(state, fallback=True) == 1
        assert same(values(state), saved[1])
        assert [s for s, _ in ck.last_restore_skipped] == [3, 2]
        assert "manifest" in ck.last_restore_skipped[1][1]

        # nothing restores: an error naming every step, never a silent start from scratch
        flip_byte(chunk_files(root, 1)[0])
        before = values(state)
        with pytest.raises(CheckpointError, match=r"no committed checkpoint restores.*step 3.*step 2.*step 1"):
            ck.restore(state, fallback=True)
        assert same(values(state), before)


def test_hook_resume_with_fallback_starts_after_the_newest_good_step(job):
    root, saved = job
    flip_byte(chunk_files(root, 3)[0])
    with Checkpointer(root) as ck:
        state = make_state(seed=7)
        with pytest.raises(CorruptChunkError):
            CheckpointHook(ck, state, every_n_steps=None, save_on_signal=False).resume()
        hook = CheckpointHook(ck, state, every_n_steps=None, save_on_signal=False, fallback=True)
        assert hook.resume() == 3
        assert same(values(state), saved[2])
        hook.close()


def test_verify_all_records_verdicts_that_ls_shows_and_gc_keeps_the_newest_verified(job):
    root, _ = job
    commits = commit_digests(root)
    out = cli("verify", root, "--all")
    assert out.returncode == 0, out.stderr
    rows = {r["step"]: r["verified"] for r in json.loads(cli("ls", root, "--json").stdout)}
    assert rows == {1: "ok", 2: "ok", 3: "ok"}
    assert commit_digests(root) == commits  # the verdict never touches committed bytes
    assert cli("verify", root, "--step", "2").returncode == 0  # verify still reads around the record

    flip_byte(chunk_files(root, 3)[0])
    out = cli("verify", root, "--all", "--json")
    assert out.returncode == 1
    doc = {r["step"]: r for r in json.loads(out.stdout)}
    assert doc[3]["ok"] is False and doc[2]["ok"] is True and doc[1]["ok"] is True
    assert all(r["recorded"] for r in doc.values())
    assert "crc32c" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    table = cli("ls", root).stdout.splitlines()
    assert table[0].split()[6] == "VERIFIED"
    assert [line.split()[6] for line in table[1:]] == ["ok", "ok", "bad"]
    record = json.loads((Path(root) / STEP_DIR.format(3) / "_verify.json").read_text())
    assert record["ok"] is False and "crc32c" in record["errors"][0]

    # gc --keep-last 1 keeps the newest (bad) step and the newest verified one, deletes step 1
    out = cli("gc", root, "--keep-last", "1", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["deleted"] == [1] and doc["kept"] == [2, 3]
    assert doc["deleted_objects"] > 0 and doc["deleted_bytes"] > 0
    assert not (Path(root) / STEP_DIR.format(1)).exists()

    # restore(fallback=True) skips the step recorded bad without reading it
    with Checkpointer(root) as ck:
        assert ck.restore(make_state(seed=5), fallback=True) == 2
        assert "ckptd verify recorded it bad" in ck.last_restore_skipped[0][1]


def test_quarantine_retires_a_bad_step_keeps_its_bytes_and_the_job_saves_it_again(job):
    root, saved = job
    bad_chunk = chunk_files(root, 3)[0]
    flip_byte(bad_chunk)
    damaged = bad_chunk.read_bytes()
    rel = bad_chunk.relative_to(Path(root) / STEP_DIR.format(3))

    out = cli("quarantine", root, "--step", "3", "--reason", "crc32c mismatch")
    assert out.returncode == 0, out.stderr
    assert "quarantined" in out.stdout
    rows = json.loads(cli("ls", root, "--json").stdout)
    assert [r["step"] for r in rows] == [1, 2]
    listed = json.loads(cli("quarantine", root, "--list", "--json").stdout)
    assert [(r["step"], r["reason"]) for r in listed] == [(3, "crc32c mismatch")]
    kept = Path(root) / "_quarantine" / listed[0]["id"]
    assert (kept / rel).read_bytes() == damaged  # the bytes stay for inspection
    assert (kept / "commit.json").exists() and (kept / "quarantine.json").exists()

    with Checkpointer(root) as ck:
        state = make_state(seed=11)
        assert ck.restore(state) == 2 and same(values(state), saved[2])
        ck.save(3, make_state(seed=12)).result()  # the step number is free again
        assert ck.latest_step() == 3

    out = cli("unquarantine", root, "--step", "3")
    assert out.returncode == 1 and "not empty" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert cli("quarantine", root, "--step", "7").returncode == 1  # not committed

    # a good step quarantined by mistake comes back whole
    assert cli("quarantine", root, "--step", "2").returncode == 0
    assert [r["step"] for r in json.loads(cli("ls", root, "--json").stdout)] == [1, 3]
    out = cli("unquarantine", root, "--step", "2")
    assert out.returncode == 0, out.stderr
    assert cli("verify", root, "--step", "2").returncode == 0
    with Checkpointer(root) as ck:
        state = make_state(seed=13)
        assert ck.restore(state, step=2) == 2 and same(values(state), saved[2])


@pytest.mark.s3
def test_quarantine_on_s3_copies_then_deletes(s3_bucket):
    saved = {}
    with Checkpointer(s3_bucket) as ck:
        for step in (1, 2):
            state = make_state(seed=step)
            ck.save(step, state).result()
            saved[step] = values(state)
    out = cli("quarantine", s3_bucket, "--step", "2", "--json")
    assert out.returncode == 0, out.stderr
    rec = json.loads(out.stdout)
    assert [r["step"] for r in json.loads(cli("ls", s3_bucket, "--json").stdout)] == [1]
    from storage_backends import open_store

    with open_store(s3_bucket) as store:
        kept = [o.key for o in store.list(f"_quarantine/{rec['id']}/")]
        assert f"_quarantine/{rec['id']}/manifest.json" in kept and len(kept) == rec["objects"] + 1
        assert list(store.list(f"{STEP_DIR.format(2)}/")) == []
    assert cli("unquarantine", s3_bucket, "--step", "2").returncode == 0
    with Checkpointer(s3_bucket) as ck:
        state = make_state(seed=3)
        assert ck.restore(state) == 2 and same(values(state), saved[2])


def test_in_place_restore_of_an_invalid_manifest_says_nothing_was_read(job):
    root, _ = job
    truncate(Path(root) / STEP_DIR.format(3) / "manifest.json", 40)
    state = make_state(seed=21)
    before = values(state)
    with Checkpointer(root) as ck, pytest.raises(CheckpointError) as err:
        ck.restore(state, in_place=True)
    assert "manifest" in str(err.value)
    assert "nothing was read: the state is unchanged" in str(err.value)
    assert "partly overwritten" not in str(err.value)
    assert same(values(state), before)


def test_in_place_restore_of_a_corrupt_chunk_still_says_the_state_may_be_overwritten(job):
    root, _ = job
    flip_byte(chunk_files(root, 3)[0])
    with Checkpointer(root) as ck, pytest.raises(CorruptChunkError, match="partly overwritten"):
        ck.restore(make_state(seed=22), in_place=True)
