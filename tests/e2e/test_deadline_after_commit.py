"""``save_timeout`` bounds the whole save, from ``save`` to the future's outcome, even when the
store stops answering right after a commit (issue 28, item 5). The sweep and retention after the
commit of step 1 used to run on the writer thread: with storage stalled, step 2 waited in the
queue behind them, where its deadline never applied, for the S3 client's per-call timeouts
(about 40 minutes with the defaults).

A real moto server behind the fault proxy: step 1 commits; the sweep after its commit (its
listing of uploads) stalls, and so does every request after it. Step 2's
future must fail with the save_timeout error. No duration is asserted: the guard is generous, far
below the per-call timeouts configured here."""

from __future__ import annotations

import pytest
import torch

from ckptd import manifest as mf
from ckptd.errors import CheckpointError
from tests import load
from tests.doubles.faults import FaultPlan, FaultProxy, Rule
from trainer_hooks import Checkpointer

pytestmark = [pytest.mark.s3, pytest.mark.timeout(300)]
GUARD_S = 120  # far above save_timeout below, far below one stalled S3 call (600 s)


def test_a_stall_after_a_commit_does_not_hold_the_next_save_past_its_deadline(s3_bucket, s3_server, monkeypatch):
    monkeypatch.setenv("CKPTD_S3_READ_TIMEOUT", "600")
    monkeypatch.setenv("CKPTD_S3_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("CKPTD_S3_RETRIES", "0")
    seen_commit = []
    proxy = FaultProxy(s3_server)

    def stall_after_commit(req) -> bool:
        if req.method == "PUT" and req.path.endswith(f"/{mf.step_dir(1)}/{mf.COMMIT}"):
            seen_commit.append(req.path)
            return False  # the commit record itself goes through
        if seen_commit and req.op == "ListMultipartUploads":  # the sweep after the commit
            proxy.stall_all()  # this request and every later one: the endpoint stops answering
            return True
        return False

    proxy.set_plan(FaultPlan(rules=[Rule(stall_after_commit, "stall")]))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    ck = Checkpointer(s3_bucket, keep_last=1, save_timeout=load.scaled(5))  # step 1: ~1 s idle
    try:
        state = {"w": torch.randn(16, 16)}
        ck.save(1, state).result(timeout=GUARD_S)
        assert seen_commit, "step 1 committed without its commit record passing the proxy"
        fut = ck.save(2, state)
        exc = fut.exception(timeout=GUARD_S)
        assert isinstance(exc, CheckpointError) and "save_timeout" in str(exc), exc
        assert proxy.counters["fault:stall"] >= 1  # the after-commit work really was stalled
    finally:
        proxy.close()  # the stalled calls end (connections reset), so close() can return
        ck.close()
