"""Bounded fuzzing (hypothesis) of verify records (``_verify.json``, issue 27 item 3): whatever a
root writer puts there, every reader (``ls``'s status, gc's selection, fallback's order) gets None
or a well-typed verdict bound to the step's bytes, never an exception."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptd import retention
from ckptd import verify as _verify
from storage_backends import memory
from tests.protocol.parts import committed_step

pytestmark = pytest.mark.timeout(600)

N = int(os.environ.get("CKPTD_FUZZ_EXAMPLES", "40"))
SETTINGS = settings(
    max_examples=N * 5,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
FIELDS = ["step", "ok", "judged", "attempt", "commit_time", "time", "arrays", "objects", "bytes", "errors"]
_leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=80)
)
JSON = st.recursive(
    _leaf,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@pytest.fixture(scope="module")
def store():
    s = memory.MemoryStore("memory://verdict-fuzz")
    committed_step(s, 1)
    return s


def good_record(store) -> dict:
    rep = _verify.VerifyReport(1, arrays=1, objects=2, bytes=40)
    return _verify.write_record(store, rep)


@SETTINGS
@given(
    field=st.sampled_from(FIELDS),
    value=JSON,
    drop=st.booleans(),
    raw=st.one_of(st.none(), st.binary(max_size=64)),
)
def test_a_mutated_verdict_reads_as_none_or_a_valid_one(store, field, value, drop, raw, caplog):
    rec = good_record(store)
    if raw is not None:
        data = raw
    else:
        if drop:
            rec.pop(field, None)
        else:
            rec[field] = value
        data = json.dumps(rec, allow_nan=True).encode()
    store.put(_verify.record_key(1), data)
    with caplog.at_level(logging.WARNING):
        got = _verify.read_record(store, 1)
        status = _verify.status(store, 1)
        doomed = retention.select_for_deletion(store, 1)
    assert doomed == []
    if got is None:
        assert status == "unverified"
        return
    assert isinstance(got["ok"], bool) and status == ("ok" if got["ok"] else "bad")
    assert got["judged"] == _verify.judged_digest(store, 1)
    assert isinstance(got["errors"], list) and all(isinstance(e, str) for e in got["errors"])
    assert got["ok"] == (not got["errors"])
    assert np.isfinite(got["time"])
