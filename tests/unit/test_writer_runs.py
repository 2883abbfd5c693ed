"""The manifest's ``writers`` (``Grid.writer_runs``) name the rank that wrote every shard, for
every kind of grid the planner makes: a restore reads the pins of those ranks' done records
only (issue 26), so a wrong run would make a restore refuse a good checkpoint."""

from __future__ import annotations

import pytest

from ckptd import manifest as mf
from ckptd.layout import Box, plan_grid, shard_index
from tests.unit.test_layout import LAYOUTS, fsdp, fsdp_tp, hsdp

CASES = [
    *LAYOUTS,
    ("fsdp-64", (64 * 10, 64), fsdp((64 * 10, 64), 64)),
    ("replicated-split", (4096, 1024), [Box.full((4096, 1024))] * 4),
    ("hsdp", (4096, 64), hsdp((4096, 64), 2, 3)),
    ("fsdp-tp", (4096, 64), fsdp_tp((4096, 64), 2, 2)),
]


@pytest.mark.parametrize("name,shape,blocks", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("key", ["model/w", "opt/state/x/exp_avg", "k3"])
def test_writer_runs_name_every_shards_writer(name, shape, blocks, key):
    grid = plan_grid(shape, 4, "float32", blocks)
    entry = mf.TensorEntry(key, grid.layout, writers=grid.writer_runs(key))
    back = mf.TensorEntry.from_json(entry.to_json())  # as a restore reads it from the manifest
    assert back.writers == entry.writers
    for i, coord in enumerate(grid.coords):
        assert back.writer_of(shard_index(grid.layout, coord)) == grid.writer(key, i), (name, coord)
    assert len(entry.writers) <= 2 or name not in ("fsdp-64", "replicated-split")


def test_malformed_writers_are_refused():
    from ckptd.errors import CheckpointError

    grid = plan_grid((16, 4), 4, "float32", fsdp((16, 4), 4))
    d = mf.TensorEntry("w", grid.layout, writers=grid.writer_runs("w")).to_json()
    for bad in ([[0, -1, 2]], [[0, 1]], "x", [[0, 1, 2.5]]):
        m = (
            mf.Manifest(1, 4, {}, {})
            .to_bytes()
            .replace(b'"tensors":[]', b'"tensors":[' + mf.dumps({**d, "writers": bad}) + b"]")
        )
        with pytest.raises(CheckpointError, match="writers"):
            mf.Manifest.from_bytes(m, "here")
