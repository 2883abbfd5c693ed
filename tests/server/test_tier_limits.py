"""The memory tier against the daemon's real resource limits (``ckptd.server.capacity``), with real
daemons started under a low ``RLIMIT_NOFILE``: every held object costs descriptors (a memfd, and
``mmap``'s duplicate of it before Python 3.13) and a mapping. A daemon whose copies would use up
its descriptors keeps saving: the copy degrades to persist-only (WARNING,
``ckptd_tier_degraded_total``), no save fails or retries for lack of a descriptor, no reservation
is left behind and no part of the copy is served; a replica receiver out of descriptors refuses
the replica (HTTP 429, logged by the pusher) and keeps serving its own saves."""

from __future__ import annotations

import resource

import pytest
import torch

from tests.distributed import launch
from tests.server.daemon import Daemon, node, wait_for
from trainer_hooks import Checkpointer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOKEN = "tier-limits-token-0123456789"
NOFILE = 800  # the daemons' open-files limit (soft and hard: they cannot raise it)
TENSORS = 300  # shard objects of a step: two per tensor (its zarr.json and its one chunk), and one


def _low_nofile() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


def _state(n: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(4, generator=g) for i in range(n)}


def _tiers(d: Daemon) -> dict:
    code, body = d.get("/v1/tiers", TOKEN)
    assert code == 200, body
    return body  # type: ignore[return-value]


def _daemon(tmp, name: str, root: str, port: int, peers: list[str], low: bool) -> Daemon:
    # Share 1: these tests are about the descriptor limit, which --tenant-share would reach first.
    return node(tmp, name, root, port, peers, preexec_fn=_low_nofile if low else None, CKPTD_TENANT_SHARE="1")


@pytest.fixture
def token(tmp_path, monkeypatch):
    (tmp_path / "token").write_text(TOKEN)
    (tmp_path / "token").chmod(0o600)
    monkeypatch.setenv("CKPTD_TOKEN", TOKEN)


def test_a_daemon_short_of_descriptors_keeps_saving_persist_only(tmp_path, token):
    root = f"file://{tmp_path / 'job'}"
    port = launch.free_port()
    d = _daemon(tmp_path, "a", root, port, [], low=True)
    try:
        assert f"capacity: open files {NOFILE}, vm.max_map_count" in d.logs()
        assert d.metric("ckptd_open_files_limit", TOKEN) == NOFILE
        assert 0 < d.metric("ckptd_tier_objects_limit", TOKEN) < NOFILE
        states = {s: _state(TENSORS, s) for s in (1, 2, 3)}
        with Checkpointer(root, daemon=d.socket_url) as ck:
            for s, state in states.items():
                ck.save(s, state).result()  # never a failed save
        logs = d.logs()
        assert "Too many open files" not in logs and "upload failed" not in logs, logs
        assert "the step is persist-only here" in logs and "all this daemon's limits allow now" in logs
        assert d.metric("ckptd_tier_degraded_total", TOKEN) >= len(states)
        t = _tiers(d)
        assert t["hot"] == [] and t["reserved_bytes"] == 0, t  # nothing half-kept, nothing leaked
        assert d.metric("ckptd_tier_objects", TOKEN) == 0
        with Checkpointer(root) as ck:  # every step is whole in the job root
            for s, state in states.items():
                got = {k: torch.zeros(4) for k in state}
                assert ck.restore(got, step=s) == s
                assert all(torch.equal(got[k], v) for k, v in state.items()), s

        # A step that fits the limits still gets its hot copy on the same daemon.
        small = _state(20, 9)
        with Checkpointer(root, daemon=d.socket_url) as ck:
            ck.save(4, small).result()
        wait_for(lambda: [c["step"] for c in _tiers(d)["hot"]] == [4], "the hot copy of step 4", 60, (), d.logs)
        assert d.metric("ckptd_tier_objects", TOKEN) == _tiers(d)["hot"][0]["objects"] > 0
    finally:
        d.kill()


def test_a_replica_receiver_short_of_descriptors_refuses_it_and_keeps_serving(tmp_path, token):
    root = f"file://{tmp_path / 'job'}"
    pa, pc = launch.free_port(), launch.free_port()
    urls = [f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pc}"]
    a = _daemon(tmp_path, "a", root, pa, urls, low=False)
    c = _daemon(tmp_path, "c", root, pc, urls, low=True)
    try:
        with Checkpointer(root, daemon=a.socket_url) as ck:
            ck.save(1, _state(TENSORS, 1)).result()
        wait_for(
            lambda: a.metric("ckptd_tier_replica_push_failures_total", TOKEN) >= 1,
            "a's push to c to be refused",
            120,
            (),
            lambda: a.logs() + c.logs(),
        )
        assert [h["step"] for h in _tiers(a)["hot"]] == [1]  # the pusher keeps its own copy
        assert "HTTP 429" in a.logs() and f"to {c.url} failed" in a.logs(), a.logs()
        t = _tiers(c)
        assert t["replicas"] == [] and t["reserved_bytes"] == 0, t
        assert c.metric("ckptd_tier_degraded_total", TOKEN) >= 1
        assert c.metric("ckptd_tier_objects", TOKEN) == 0
        assert "Too many open files" not in c.logs(), c.logs()

        # c still serves its own saves, and a small replica still fits.
        state = _state(10, 2)
        with Checkpointer(root, daemon=c.socket_url) as ck:
            ck.save(2, state).result()
        with Checkpointer(root, daemon=a.socket_url) as ck:
            ck.save(3, _state(10, 3)).result()
        wait_for(lambda: [r["step"] for r in _tiers(c)["replicas"]] == [3], "the small replica on c", 120, (), c.logs)
    finally:
        for d in (a, c):
            d.kill()


def test_memory_only_steps_past_the_descriptor_limit_are_persisted_instead(tmp_path, token):
    # Before the reservation counted objects, the bytes fit, the hand-off was accepted, and the
    # part then failed to be held for lack of descriptors: a failed save. Now the daemon refuses
    # the reservation, the ranks agree, and the step is persisted like any other.
    root = f"file://{tmp_path / 'job'}"
    d = _daemon(tmp_path, "a", root, launch.free_port(), [], low=True)
    try:
        states = {s: _state(TENSORS, s) for s in (1, 2, 3)}
        with Checkpointer(root, daemon=d.socket_url, persist_every=2) as ck:
            for s, state in states.items():
                ck.save(s, state).result()  # never a failed save
        logs = d.logs()
        assert "do not fit the" in logs and "persisted to the job root instead" in logs, logs
        assert d.metric("ckptd_tier_persisted_instead_total", TOKEN) >= 2
        assert "memory-only step: " not in logs, logs  # no part failed at hold time
        with Checkpointer(root) as ck:  # steps 1 and 3, meant to be memory-only, are in the root
            for s, state in states.items():
                got = {k: torch.zeros(4) for k in state}
                assert ck.restore(got, step=s) == s
                assert all(torch.equal(got[k], v) for k, v in state.items()), s
    finally:
        d.kill()
