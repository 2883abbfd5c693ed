"""A trainer of one tenant, run as that local user, for ``test_tenancy.py``.

``python -m tests.security.tenant USER WORKDIR`` is started as root: it imports everything it will
use and runs one in-process save and restore on a scratch root in ``WORKDIR`` (so that nothing is
imported later: the interpreter and its packages live under ``/root``, which other users cannot
read), then drops to ``USER`` for good (its groups, then gid and uid: real, effective and saved)
before it talks to the daemon. From there on the kernel sees a process of that user: the daemon's
``SO_PEERCRED``, file owners and every permission check are the user's.

Commands on stdin, one JSON object per line; one JSON reply per line on stdout:

* ``{"op": "open", "root": R, "daemon": URL}``: a ``Checkpointer(R, daemon=URL)`` (and
  ``persist_every`` when the command names it), closing the one open before;
* ``{"op": "save", "step": N, "seed": S}``: save ``state(S)`` as step N and wait for its commit
  (with ``"tensors": T``, a state of T tiny tensors instead: many small objects);
* ``{"op": "lease"}``: the staging lease the open Checkpointer holds (id and folder);
* ``{"op": "restore", "root": R}``: an in-process restore of R's latest step (through the daemon
  ``daemon`` when the command names one): the step and a digest of the restored tensor (with
  ``"tiers": true``, also the bytes it read from each tier: ``last_restore_tiers``);
* ``{"op": "http", "daemon": URL, "method": M, "path": P, "body": B}``: one request (with the
  ticket ``vouch`` when the command names one: ``X-Ckptd-Vouch``);
* ``{"op": "data", "socket": PATH | "port": N, "request": H}``: one request ``H`` (the token
  added) on the tier data path (``ckptd.server.tierdata``): its reply header, and the sha256 of
  the bytes that follow it;
* ``{"op": "push", "daemon": URL, "root": R, "step": N, ...}``: a whole memory-only replica of
  rank 0 of step N of R pushed with the token, as a trainer could try (``POST
  /v1/tiers/replicas``, its pieces, its seal; ``source`` "self" unless the command names one):
  the statuses it got, up to the first refusal. Its objects: ``objects`` (key -> text), or with
  ``copy`` ({"daemon", "root", "step"}) the bytes of that memory-only part, read from that
  daemon as the caller (its ``attempt`` too, unless the command names one);
* ``{"op": "quit"}``.
"""

from __future__ import annotations

import contextlib
import encodings.idna  # noqa: F401 - http.client encodes host names with it, lazily
import hashlib
import json
import os
import pwd
import socket
import sys
import traceback
import urllib.parse

import torch

import trainer_hooks.daemon_sink  # noqa: F401 - imported while the interpreter is readable
import trainer_hooks.memsteps  # noqa: F401
from ckptd.auth import daemon_token
from ckptd.codec import crc32c
from ckptd.daemon_conn import DaemonConnection
from ckptd.tierwire import REPLY, REQUEST, recv_exact, recv_frame, send_frame
from trainer_hooks import Checkpointer


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 32, generator=g)}}


def tiny(n: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"t{i}": torch.randn(1, generator=g) for i in range(n)}}


def digest(st: dict) -> str:
    return hashlib.sha256(st["model"]["w"].contiguous().numpy().tobytes()).hexdigest()


def restore(root: str, daemon: str | None = None, tiers: bool = False) -> dict:
    target = {"model": {"w": torch.zeros(64, 32)}}
    with Checkpointer(root, daemon=daemon) as ckpt:
        step = ckpt.restore(target)
        read = {"tiers": dict(ckpt.last_restore_tiers or {})} if tiers else {}
    return {"step": step, "digest": digest(target) if step is not None else None} | read


def data_read(cmd: dict) -> dict:
    if "socket" in cmd:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(cmd["socket"])
    else:
        sock = socket.create_connection(("127.0.0.1", cmd["port"]))
    with sock:
        sock.settimeout(30)
        send_frame(sock, REQUEST, {"token": daemon_token(), **cmd["request"]})
        header = recv_frame(sock, REPLY)[0]
        body = bytearray(header.get("length", 0) if header.get("ok") else 0)
        recv_exact(sock, memoryview(body))
    return header | {"sha256": hashlib.sha256(body).hexdigest()}


def push(cmd: dict) -> list[int]:
    objects = {k: v.encode() for k, v in cmd.get("objects", {}).items()}
    attempt = cmd.get("attempt")
    if "copy" in cmd:
        src = cmd["copy"]
        conn = DaemonConnection(src["daemon"], daemon_token())
        try:
            q = urllib.parse.urlencode({"root": src["root"], "keys": "true"})
            status, _, raw = conn.fetch("GET", f"/v1/tiers?{q}")
            assert status == 200, raw[:500]
            (part,) = [p for p in json.loads(raw)["memory_only"] if p["step"] == src["step"]]
            attempt = attempt or part["attempt"]
            for key, size in part["keys"].items():
                q = urllib.parse.urlencode({"root": src["root"], "step": src["step"], "attempt": part["attempt"]})
                q += "&" + urllib.parse.urlencode({"key": key, "start": 0, "length": size})
                status, _, objects[key] = conn.fetch("GET", f"/v1/tiers/object?{q}")
                assert status == 200 and len(objects[key]) == size, objects[key][:500]
        finally:
            conn.close()
    body = {"root": cmd["root"], "step": cmd["step"], "attempt": attempt or "forged", "ranks": [0]}
    body |= {"kind": "memory_only", "source": cmd.get("source", "self")}
    body["objects"] = [{"key": k, "size": len(v), "crc32c": crc32c(v)} for k, v in objects.items()]
    conn = DaemonConnection(cmd["daemon"], daemon_token())
    try:
        return push_replica(conn, body, objects)
    finally:
        conn.close()


def push_replica(conn: DaemonConnection, body: dict, objects: dict[str, bytes]) -> list[int]:
    """A trainer's push of a whole replica with the token only (no peer signature): the statuses
    it got, stopping at the first refusal."""
    status, _, raw = conn.fetch("POST", "/v1/tiers/replicas", body)
    got = [status]
    if status != 200:
        return got
    rid = json.loads(raw)["replica"]
    for key, data in objects.items():
        piece = f"/v1/tiers/replicas/{rid}?key={urllib.parse.quote(key, safe='')}&offset=0"
        got.append(conn.fetch("PUT", piece, data)[0])
    got.append(conn.fetch("POST", f"/v1/tiers/replicas/{rid}/seal", {})[0])
    return got


def drop_to(user: str) -> None:
    pw = pwd.getpwnam(user)
    os.setgroups(os.getgrouplist(pw.pw_name, pw.pw_gid))
    os.setresgid(pw.pw_gid, pw.pw_gid, pw.pw_gid)
    os.setresuid(pw.pw_uid, pw.pw_uid, pw.pw_uid)
    assert os.getresuid() == (pw.pw_uid,) * 3


def main() -> None:
    user, work = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    scratch = os.path.join(work, f"warmup-{os.getpid()}")
    with Checkpointer(scratch) as ckpt:  # every module of a save and a restore, imported now
        ckpt.save(1, state(0)).result()
    restore(scratch)
    drop_to(user)
    os.umask(0o022)
    os.environ["HOME"] = work
    os.chdir(work)
    ckpt = None
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "open":
                if ckpt is not None:
                    ckpt.close()
                ckpt = Checkpointer(cmd["root"], daemon=cmd["daemon"], persist_every=cmd.get("persist_every", 1))
                out = {"ok": True}
            elif op == "save":
                st = tiny(cmd["tensors"], cmd["seed"]) if "tensors" in cmd else state(cmd["seed"])
                ckpt.save(cmd["step"], st).result(timeout=120)
                out = {"ok": True}
            elif op == "lease":
                stager = ckpt._stager
                out = {"lease": stager.lease_id, "dir": str(stager._dir)}
            elif op == "restore":
                out = restore(cmd["root"], cmd.get("daemon"), cmd.get("tiers", False))
            elif op == "http":
                client = DaemonConnection(cmd["daemon"], daemon_token())
                client.vouch = cmd.get("vouch")
                try:
                    status, body, _ = client.call(cmd["method"], cmd["path"], cmd.get("body"))
                finally:
                    client.close()
                out = {"status": status, "body": body}
            elif op == "data":
                out = data_read(cmd)
            elif op == "push":
                out = {"statuses": push(cmd)}
            elif op == "quit":
                break
            else:
                out = {"error": f"unknown op {op}"}
        except Exception as e:  # noqa: BLE001 - the test reads the error
            out = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        print(json.dumps(out), flush=True)
    if ckpt is not None:
        with contextlib.suppress(Exception):  # a refused save may be reported again at close
            ckpt.close()


if __name__ == "__main__":
    main()
