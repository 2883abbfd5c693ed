"""The status page's *Memory-only steps* section (issue 29, item 5), with real daemons on loopback:
which memory-only steps of each root a daemon holds, its own parts (and the peers they were
replicated to) and the replicas it holds (and the peer each came from), whether it holds the
step whole, and the bytes. The job root's name is hostile: everything on the page is escaped."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import launch
from tests.server.daemon import Daemon, node, wait_for
from trainer_hooks import Checkpointer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TOKEN = "page-memsteps-token-0123456789"
HOSTILE = "job<img src=x onerror=alert(1)>\"'&"


def _page(d: Daemon) -> str:
    code, body = d.get("/v1/page", TOKEN)
    assert code == 200, body
    return body["html"]  # type: ignore[index]


def test_the_page_shows_memory_only_steps_pernode(tmp_path, monkeypatch):
    (tmp_path / "token").write_text(TOKEN)
    (tmp_path / "token").chmod(0o600)
    monkeypatch.setenv("CKPTD_TOKEN", TOKEN)
    job = tmp_path / HOSTILE
    root = f"file://{job}"
    pa, pc = launch.free_port(), launch.free_port()
    urls = [f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pc}"]
    a = node(tmp_path, "a", root, pa, urls)
    c = node(tmp_path, "c", root, pc, urls)
    try:
        assert '<section id="memsteps">' in _page(a) and "no memory-only step held" in _page(a)
        state = {"w": torch.randn(16, 4), "b": torch.randn(4)}
        with Checkpointer(root, daemon=a.socket_url, persist_every=2) as ck:
            ck.save(1, state).result()  # memory-only: held by a, replicated to c
        wait_for(lambda: 'data-step="1"' in _page(c), "c to hold the replica of step 1", 60, (), c.logs)

        code, ov = a.get("/v1/overview", TOKEN)
        assert code == 200, ov
        (step,) = ov["memory_only"]
        assert step["root"] == root and step["step"] == 1 and step["world_size"] == 1 and step["whole_here"]
        (part,) = step["parts"]
        assert part["rank"] == 0 and part["source"] == "self" and part["bytes"] == step["bytes"] > 0
        assert part["replicated_to"] == {c.url: "complete"}

        html = _page(a)
        assert '<tr class="memstep memstep-whole part-own" data-step="1" data-rank="0">' in html, html
        assert "whole: all 1 ranks" in html and f"{c.url}: complete" in html
        html = _page(c)
        assert '<tr class="memstep memstep-whole part-replica" data-step="1" data-rank="0">' in html, html
        assert f"replica from {a.url}" in html
        for html in (_page(a), _page(c)):
            section = html[html.index('<section id="memsteps">') :]
            section = section[: section.index("</section>")]
            assert "<img" not in section and "job&lt;img src=x onerror=alert(1)&gt;&quot;&#x27;&amp;" in section
        # step 2 is persisted: not a memory-only step, and it is not listed as one
        with Checkpointer(root, daemon=a.socket_url, persist_every=2) as ck:
            ck.save(2, state).result()
        code, ov = a.get("/v1/overview", TOKEN)
        assert [s["step"] for s in ov["memory_only"]] == [1], ov["memory_only"]
    finally:
        for d in (a, c):
            d.kill()
