"""Issue 27 item 1: ``ckptd.open_array`` and ``ckptd.open_group`` on a job root someone else
can write. Each attack is performed for real on a local root (links, a FIFO, ``/dev/zero``, a
crafted ``zarr.json`` over a gzip bomb); the read runs in a subprocess (``open_attack.py``) so
that a hang is a timeout and its peak RSS is its own. Every attack must be refused with a
``CheckpointError`` and must never return another root's values."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from tests.security.conftest import REPO, env, make_root, small_state
from trainer_hooks import Checkpointer

pytestmark = pytest.mark.timeout(300)
HERE = Path(__file__).parent
ARRAY = "step_0000000001/arrays/model/w"
RSS_MB = 700  # a refused read stays far under this; the bomb decoded is gigabytes


def _read(root: Path, how: str) -> dict:
    p = subprocess.run(
        [sys.executable, str(HERE / "open_attack.py"), str(root), "model/w", how],
        capture_output=True,
        text=True,
        timeout=120,  # a read blocked on a FIFO fails the test here instead of hanging it
        env=env(),
        cwd=str(REPO),
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"{how}: {out['outcome']} {out.get('type', '')}: peak RSS {out['peak_rss_mb']:.0f} MiB")
    return out


@pytest.fixture()
def roots(tmp_path):
    """(this job's root, another root whose step 1 holds other values)."""
    other = tmp_path / "other"
    ckpt = Checkpointer(str(other))
    try:
        ckpt.save(1, small_state(7)).result()
    finally:
        ckpt.close()
    return make_root(tmp_path / "job", steps=(1,)), other


def _refused(out: dict) -> None:
    assert out["outcome"] == "refused", out
    assert out["checkpoint_error"], out
    assert "\n" not in out["message"]
    assert out["peak_rss_mb"] < RSS_MB


@pytest.mark.parametrize("how", ["array", "group"])
def test_the_untouched_checkpoint_reads_back(roots, how):
    root, _ = roots
    out = _read(root, how)
    assert out["outcome"] == "values", out
    assert np.array_equal(np.array(out["values"], dtype=np.float32), small_state(1)["model"]["w"].numpy())


@pytest.mark.parametrize("how", ["array", "group"])
@pytest.mark.parametrize("what", ["array folder", "arrays/", "shard"])
def test_links_to_another_root_are_not_followed(roots, how, what):
    root, other = roots
    rel = {"array folder": ARRAY, "arrays/": "step_0000000001/arrays", "shard": f"{ARRAY}/c/0/0"}[what]
    target = root / rel
    shutil.rmtree(target) if target.is_dir() else os.unlink(target)
    os.symlink(other / rel, target)
    _refused(_read(root, how))


@pytest.mark.parametrize("how", ["array", "group"])
def test_a_fifo_shard_does_not_hang(roots, how):
    root, _ = roots
    os.unlink(root / ARRAY / "c/0/0")
    os.mkfifo(root / ARRAY / "c/0/0")
    _refused(_read(root, how))


@pytest.mark.parametrize("how", ["array", "group"])
def test_a_dev_zero_shard_is_not_read(roots, how):
    root, _ = roots
    os.unlink(root / ARRAY / "c/0/0")
    os.symlink("/dev/zero", root / ARRAY / "c/0/0")
    _refused(_read(root, how))


SEGMENT = 1 << 24
SEGMENTS = 640
BOMB_CRC = 0xF41D912F  # zlib.crc32 of SEGMENTS * SEGMENT zero bytes (6 s to compute each run)


def gzip_bomb() -> bytes:
    """About 10 MiB of gzip that decodes to 10 GiB of zeros: one raw deflate segment of 16 MiB
    zeros, ended by a full flush (so it depends on nothing before it), repeated 640 times."""
    co = zlib.compressobj(9, zlib.DEFLATED, -15)
    seg = co.compress(bytes(SEGMENT)) + co.flush(zlib.Z_FULL_FLUSH)
    total = SEGMENTS * SEGMENT
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"
    return header + seg * SEGMENTS + co.flush() + BOMB_CRC.to_bytes(4, "little") + (total % 2**32).to_bytes(4, "little")


@pytest.mark.parametrize("how", ["array", "group"])
def test_a_gzip_codec_in_a_crafted_zarr_json_is_refused_before_decoding(roots, how):
    root, _ = roots
    meta_path = root / ARRAY / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["codecs"] = [
        {"name": "bytes", "configuration": {"endian": "little"}},
        {"name": "gzip", "configuration": {"level": 1}},
    ]
    meta_path.write_text(json.dumps(meta))
    (root / ARRAY / "c/0/0").write_bytes(gzip_bomb())
    out = _read(root, how)
    _refused(out)
    assert "zarr.json" in out["message"] and "codecs" in out["message"], out
