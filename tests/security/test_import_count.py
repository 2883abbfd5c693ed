"""Issue 27 item 11: an import's work is bounded by its tensor count, not only its bytes.

A 20 MB safetensors header describing 300,000 empty tensors kept ``ckptd import`` running for
over 20 minutes (and writing 74,000 files): the count is now refused as soon as the header is
read, with an error naming the bound and how to raise it; and the per-tensor work no longer
grows with the tensors already written (a running total of the writes in flight instead of a
sum over them, heap trims and page releases per 16 MiB instead of per tensor)."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from ckptd import catalog
from ckptd.errors import CheckpointError
from ckptd.interop import import_checkpoint
from ckptd.interop.common import MAX_TENSORS
from storage_backends import open_store
from tests.security.conftest import assert_one_line_error, cli

pytestmark = pytest.mark.timeout(300)


def _empty_tensors_header(path, n: int) -> None:
    header = {f"layers.{i}.w": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(n)}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def test_300k_empty_tensors_are_refused_by_count_before_writing(tmp_path):
    src = tmp_path / "bomb.safetensors"
    _empty_tensors_header(src, 300_000)
    assert src.stat().st_size > 19 << 20
    root = tmp_path / "job"
    line = assert_one_line_error(cli("import", src, "--format", "safetensors", root, "--step", 1, timeout=240), rc=(1,))
    assert "300000 tensors" in line and f"{MAX_TENSORS}" in line and "--max-tensors" in line, line
    assert not (root / "step_0000000001").exists()  # refused before a claim or an array was written


def test_the_bound_is_configurable_and_applies_to_every_format(tmp_path):
    tensors = {f"w{i}": torch.full((2, 3), float(i)) for i in range(4)}
    st = tmp_path / "four.safetensors"
    save_file(tensors, str(st))
    pt = tmp_path / "four.pt"
    torch.save(tensors, pt)
    root = tmp_path / "job"
    line = assert_one_line_error(
        cli("import", st, "--format", "safetensors", root, "--step", 1, "--max-tensors", 3), rc=(1,)
    )
    assert "4 tensors, more than the 3" in line, line
    with open_store(str(root)) as store:
        with pytest.raises(CheckpointError, match="4 tensors, more than the 3"):
            import_checkpoint(str(pt), "torch", store, 1, max_tensors=3)  # counted in write_import
        assert catalog.latest_step(store) is None
    p = cli("import", st, "--format", "safetensors", root, "--step", 1, "--max-tensors", 4)
    assert p.returncode == 0, p.stderr
    with open_store(str(root)) as store:
        assert catalog.latest_step(store) == 1


def test_many_empty_tensors_under_the_bound_import(tmp_path):
    src = tmp_path / "many.safetensors"
    _empty_tensors_header(src, 3000)
    root = tmp_path / "job"
    p = cli("import", src, "--format", "safetensors", root, "--step", 1, timeout=240)
    assert p.returncode == 0, p.stderr
    assert "imported 3000 tensors" in p.stdout
