"""What the memory tiers hold of one job root, for ``ckptd ls --daemon URL``: asks ``GET
/v1/tiers`` of the daemon named and of every peer it names, and returns, per step, each complete
copy (a tier serves nothing else): ``hot@URL`` (the node's own), ``replica@URL`` (a peer's,
pushed from ``source``), or for a memory-only step, one per rank's part, ``memory@URL`` or
``memory-replica@URL``. A peer that does not answer is noted on stderr and left out (the
listing is a view, the job root stays the only truth of what is committed); the daemon named
not answering is a UsageError (exit 2): nothing asked for could be listed."""

from __future__ import annotations

from ckptd.cli.common import UsageError
from ckptd.errors import CheckpointError
from ckptd.server.roots import normalize
from ckptd.tierwire import ask_json

__all__ = ["tier_copies"]

MAX_REPLY = 16 << 20


def tier_copies(
    root_uri: str, daemon: str, token: str | None, timeout: float = 10.0
) -> tuple[dict[int, list[dict]], list[str]]:
    """(step -> the complete copies of it the daemons hold, each ``{"where", "kind", "daemon",
    "source", "attempt", "ranks", "bytes"}``; the daemons that did not answer, with why)."""
    want = normalize(root_uri)
    out: dict[int, list[dict]] = {}
    failed: list[str] = []
    todo, seen = [daemon.rstrip("/")], set()
    while todo:
        url = todo.pop(0)
        if url in seen:
            continue
        seen.add(url)
        try:
            body = ask_json(url, token, timeout, "GET", "/v1/tiers", cap=MAX_REPLY)
        except (ValueError, CheckpointError) as e:
            if url == daemon.rstrip("/"):  # the daemon asked for: nothing asked for can be listed
                raise UsageError(f"cannot list the memory tiers: {url}: {e or type(e).__name__}") from None
            failed.append(f"{url}: {e or type(e).__name__}")
            continue
        todo += [p.rstrip("/") for p in body.get("peers", []) if isinstance(p, str)]
        for kind, name in (("hot", "hot"), ("replicas", "replica"), ("memory_only", None)):
            for c in body.get(kind, []):
                try:
                    if not c.get("complete") or normalize(c["root"]) != want:
                        continue
                    step = int(c["step"])
                except (KeyError, TypeError, ValueError):
                    continue
                k = name or ("memory" if c.get("source") == "self" else "memory-replica")
                fields = {f: c.get(f) for f in ("source", "attempt", "ranks", "bytes")}
                out.setdefault(step, []).append({"where": f"{k}@{url}", "kind": k, "daemon": url} | fields)
    return out, failed
