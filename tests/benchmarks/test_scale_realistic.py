"""``python -m benchmarks.scale --realistic`` at a tiny size (issue 31): real manifests with
every array sharded over the ranks, rank 0's bounded I/O pool, CPU charged to the virtual clock,
the S3 store's request semantics and the partition model. Checks the invariants, never a
duration: the step commits once, the requests per rank stay bounded as N grows (O(N) in all),
and the committer's chain is counted."""

from __future__ import annotations

import json

from benchmarks import scale
from tests.doubles.simulated import SimulatedStore, VirtualClock


def test_tiny_realistic_run_commits_with_o_n_requests_and_counts_slowdowns(tmp_path):
    out = tmp_path / "r.json"
    argv = ["--realistic", "--sizes", "16,128", "--arrays", "30", "--write-s", "1", "--out", str(out)]
    argv += ["--label", "tiny"]
    assert scale.main(argv) == 0
    res = json.loads(out.read_text())["tiny"]
    small, big = res["save"]
    for s in (small, big):
        assert s["realistic"] and s["committed"] and s["failed_ranks"] == 0, s
        assert s["commit_latency_s"] is not None and s["check_cpu_s"] is not None
        assert s["cpu_charged_s"] > 0  # the CPU of the code under test took simulated time
        # every shard PUT is counted: arrays per rank, plus rank 0's array metadata
        assert s["requests_by_prefix_top"]["PUT arrays"] >= s["n"] * 30 + 30
        assert s["chain"][0].startswith("PUT _done/") and s["chain"][-1] == "PUT commit.json", s["chain"]
        assert s["chain_requests"] == len(s["chain"])
    # O(N): the protocol's requests per rank stay bounded as N grows 8-fold (the polls for the
    # commit vary with the order the ranks finish in, so a bound, not an equality)
    assert big["protocol_requests_per_rank"] <= 2 * small["protocol_requests_per_rank"] + 5, (small, big)
    assert big["requests_per_rank"] <= small["requests_per_rank"] + 5
    # one more tree level at 128 ranks than at 16: the chain grows by its PUT and LIST (and by
    # the HEAD after a 412 where the committer lost the race for a node)
    chains = [[c for c in s["chain"] if not c.startswith("HEAD ")] for s in (small, big)]
    assert len(chains[1]) == len(chains[0]) + 2, chains
    assert chains[1][-7:] == chains[0][-7:]  # the commit rules and the latest-step chain
    parts = {p["n"]: p for p in res["partitions"]}  # the request-level model: test_scale_model
    assert parts[128]["save"]["requests"] == 128 * 30 and parts[128]["save"]["failed"] == 0


def test_losing_conditional_put_heads_as_s3store_does():
    """A 412 is followed by a HEAD for the writer token (``S3Store.put_if_absent``), and a purge
    lists then deletes in batches of 1000 keys (DeleteObjects)."""
    clock = VirtualClock()
    store = SimulatedStore(clock, head_after_412=True)
    got: list = []

    def body() -> None:
        got.append(store.put_if_absent("a/k", b"1"))
        got.append(store.put_if_absent("a/k", b"2"))
        for i in range(1500):
            store.inner.put(f"b/{i:05d}", b"")
        store.reindex()
        got.append(store.purge("b/"))

    clock.spawn(body)
    clock.run(timeout=60)
    assert got[:2] == [True, False]
    assert got[2] == (1500, 0)
    assert store.stats.requests["HEAD"] == 1
    assert store.stats.requests["DELETE"] == 2 and store.stats.requests["LIST"] == 2
