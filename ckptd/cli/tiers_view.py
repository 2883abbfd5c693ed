"""What the memory tiers hold of one job root, for ``ckptd ls --daemon URL``: asks ``GET
/v1/tiers`` of the daemon named and of every peer it names, and returns, per step, each complete
copy (a tier serves nothing else): ``hot@URL`` (the node's own), ``replica@URL`` (a peer's,
pushed from ``source``), or for a memory-only step, one per rank's part, ``memory@URL`` or
``memory-replica@URL``, with ``whole``: the daemons that answered hold it whole by the restore's
rule (``commit.held_whole``). A peer that does not answer is noted on stderr and left out (the
listing is a view); the daemon named not answering is a UsageError (exit 2)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from urllib.parse import urlencode

from ckptd.cli.common import UsageError
from ckptd.commit import held_whole
from ckptd.daemon_conn import DaemonConnection
from ckptd.errors import CheckpointError
from ckptd.server.roots import normalize
from ckptd.tierwire import ask_json
from storage_backends import StorageError

__all__ = ["tier_copies"]

MAX_REPLY = 16 << 20


def tier_copies(
    root_uri: str, daemon: str, token: str | None, timeout: float = 10.0
) -> tuple[dict[int, list[dict]], list[str]]:
    """(step -> the complete copies of it the daemons hold, each ``{"where", "kind", "daemon",
    "source", "attempt", "ranks", "bytes"}``; the daemons that did not answer, with why)."""
    if token is None:  # every tier route needs it: nothing asked for could be listed
        raise UsageError("ls --daemon needs the daemons' token: set CKPTD_TOKEN_FILE (or CKPTD_TOKEN)")
    want = normalize(root_uri)
    out: dict[int, list[dict]] = {}
    failed: list[str] = []
    held: dict[tuple[int, str], tuple[str, dict]] = {}  # memory-only (step, attempt) -> (root, key -> (size, [URLs]))
    todo, seen = [daemon.rstrip("/")], set()
    while todo:
        url = todo.pop(0)
        if url in seen:
            continue
        seen.add(url)
        try:
            body = ask_json(url, token, timeout, "GET", "/v1/tiers", cap=MAX_REPLY)
            for root in {c["root"] for c in body.get("memory_only", []) if normalize(c["root"]) == want}:
                keyed = ask_json(url, token, timeout, "GET", f"/v1/tiers?{urlencode({'root': root, 'keys': 'true'})}")
                for c in keyed["memory_only"]:  # what each part holds, as a restore asks
                    table = held.setdefault((int(c["step"]), str(c["attempt"])), (root, {}))[1]
                    for k, n in c["keys"].items():
                        table.setdefault(k, (n, []))[1].append(url)
        except (ValueError, CheckpointError, KeyError, TypeError) as e:
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
    for (step, attempt), (root, holders) in held.items():

        def get(key: str, limit: int, root=root, step=step, attempt=attempt, holders=holders) -> bytes:
            size, urls = holders.get(key, (0, []))  # the object whole, from the first daemon that serves it
            q = urlencode({"root": root, "step": step, "attempt": attempt, "key": key, "start": 0, "length": size})
            for conn in (DaemonConnection(url, token, timeout) for url in urls):
                with contextlib.closing(conn), contextlib.suppress(CheckpointError):
                    status, _, raw = conn.fetch("GET", f"/v1/tiers/object?{q}")
                    if status == 200 and len(raw) <= limit:
                        return raw
            raise StorageError(f"no daemon served {key}")

        whole = False
        with contextlib.suppress(CheckpointError):
            whole = bool(held_whole(SimpleNamespace(get=get, uri=f"tiers of {root_uri}"), step, attempt, holders))
        for c in (c for c in out.get(step, []) if c["kind"].startswith("memory") and c["attempt"] == attempt):
            c["whole"] = whole
    return out, failed
