"""Item 13: ``ckptd import --format dcp`` unpickles DCP's ``.metadata`` only with ``--trust-pickle``.

The attack: a DCP folder whose ``.metadata`` is a pickle that runs code when loaded (here it
creates a marker file). Without the flag the import is refused before the file is opened."""

from __future__ import annotations

import pickle

from tests.security.conftest import assert_one_line_error, cli


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_dcp_import_refuses_to_unpickle_without_trust(tmp_path):
    src = tmp_path / "evil_dcp"
    src.mkdir()
    marker = tmp_path / "pwned"
    (src / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    p = cli("import", src, "--format", "dcp", tmp_path / "job", "--step", 1)
    line = assert_one_line_error(p, rc=(1,))
    assert "--trust-pickle" in line and "pickle" in line
    assert not marker.exists()
    assert not (tmp_path / "job").exists()

    # With the flag the user has said they trust it: the pickle is read (and runs), as torch.load would.
    p = cli("import", src, "--format", "dcp", tmp_path / "job", "--step", 1, "--trust-pickle")
    assert marker.exists()
    assert "Traceback" not in p.stderr and p.returncode == 1  # not DCP metadata: one clean error
