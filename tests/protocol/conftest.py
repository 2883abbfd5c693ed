"""The ``store`` fixture of the protocol tests: the memory store and the local filesystem store
(real files)."""

from __future__ import annotations

import pytest

from storage_backends import memory, open_store


@pytest.fixture(params=["memory", "local"])
def store(request, tmp_path):
    if request.param == "memory":
        name = f"commit-{tmp_path.name}"
        memory.reset(name)
        s = open_store(f"memory://{name}")
    else:
        s = open_store(str(tmp_path / "root"))
    yield s
    s.close()
