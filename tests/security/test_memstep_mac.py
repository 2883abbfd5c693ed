"""A memory-only step's parts are MACed for their root's binding (``replication.part_mac``,
docs/security.md, "Memory-only steps"): a part that no daemon of the ring made for that root
bound to that uid is never held, so a restore never returns its weights.

The forged part is internally consistent: another job (other weights: seed 1) saves steps 1..5
through a ckptd of the attacker's own (its own peer key, its own root), so every crc32c, pinned
size and metadata sha256 of its step-5 parts is right; the attacker then relabels them as the
victim's root. The victim is ``test_spill``'s ring: a 2-rank job whose step 3 lives in the
daemons' memory only.

- Planted as spill files in a's spill folder before a restarts (the folder is hostile input):
  each is refused (logged once), and the restore takes step 3, bitwise. The old code adopted
  them and the restore returned step 5, the forged weights.
- Pushed to a as replicas with a valid peer signature (the ring's key) but a MAC made for
  another uid's binding of the root (ckptd-bob, 1003): each is refused at its seal (400,
  logged once), and the restore takes step 3, bitwise. The old code held them and restored
  step 5.
"""

from __future__ import annotations

import json
import os
import struct
import uuid
from pathlib import Path
from urllib.parse import quote

import pytest

from ckptd.codec import crc32c
from ckptd.daemon_conn import DaemonConnection
from ckptd.server.spill import MAGIC
from tests.distributed import launch
from tests.server.daemon import PEER_KEY, Daemon, node, wait_for
from tests.server.test_spill import EVERY, LAST, SCENARIOS, TOKEN, _restore, _ring_saved, _spilled

pytestmark = pytest.mark.timeout(1200)

FORGED = 5  # the step the attacker's parts claim: newer than the victim's newest (3)
BOB = 1003  # ckptd-bob: another tenant's uid


def _read(path: Path) -> tuple[dict, list[bytes]]:
    """A spill file's header and objects (``ckptd.server.spill``)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<I", raw[len(MAGIC) : len(MAGIC) + 4])
    pos = len(MAGIC) + 4 + n
    head = json.loads(raw[len(MAGIC) + 4 : pos])
    objects = []
    for _, size, _ in head["objects"]:
        objects.append(raw[pos : pos + size])
        pos += size
    return head, objects


def _forged_parts(tmp: Path) -> list[tuple[dict, list[bytes]]]:
    """Both ranks' parts of memory-only step ``FORGED`` of another job (seed 1: other weights),
    as the attacker's own daemon (its own peer key and root) spilled them."""
    y = tmp / "attacker"
    y.mkdir()
    for name, text in (("token", TOKEN), ("own-key", "the-attackers-own-peer-key-0123456789abcdef")):
        (y / name).write_text(text)
        os.chmod(y / name, 0o600)
    (y / "spill").mkdir(mode=0o700)
    root, port = f"file://{y / 'job'}", launch.free_port()
    spill, key = str(y / "spill"), str(y / "own-key")
    d = node(y, "y", root, port, [f"http://127.0.0.1:{port}"], CKPTD_SPILL_DIR=spill, CKPTD_PEER_KEY_FILE=key)
    try:
        args = {"daemons": [d.socket_url], "root": root, "last": FORGED, "persist_every": EVERY}
        args |= {"hang": False, "seed": 1}
        procs = launch.spawn(2, "save_memory", args, y / "out", {"CKPTD_TOKEN": TOKEN}, scenarios=SCENARIOS)
        launch.wait(procs, y / "out", "save_memory", timeout=600)
        wait_for(lambda: _spilled(d, root, FORGED, {0: "self", 1: "self"}), "the attacker's parts spilled", 120)
    finally:
        d.kill()
    parts = [_read(p) for p in (y / "spill").glob("*.spill")]
    parts = [(h, o) for h, o in parts if (h["step"], h["kind"]) == (FORGED, "memory_only")]
    assert sorted(h["rank"] for h, _ in parts) == [0, 1], [h for h, _ in parts]
    return parts


def test_a_forged_spill_file_is_not_adopted(tmp_path):
    forged = _forged_parts(tmp_path)
    root, a, b, urls, out = _ring_saved(tmp_path)
    try:
        a.kill()
        names = []
        for head, objects in forged:  # relabelled as the victim's root, written as a's own files
            head = json.dumps(head | {"root": root}).encode()
            names.append(f"{uuid.uuid4().hex}.spill")
            path = tmp_path / "spill-a" / names[-1]
            path.write_bytes(MAGIC + struct.pack("<I", len(head)) + head + b"".join(objects))
            os.chmod(path, 0o600)
        a.start(port=a.port)
        _restore(a, root, out, LAST)  # step 3, bitwise: never the forged step 5
        logs = a.logs()
        for name in names:
            assert logs.count(f"{name} not adopted") == 1, logs
            assert not (tmp_path / "spill-a" / name).exists()
        assert logs.count("fails its MAC") == len(names), logs
        assert a.metric("ckptd_tier_spill_refused_total", TOKEN) == len(names)
    finally:
        a.kill()
        b.kill()


def _push(d: Daemon, sender: str, root: str, head: dict, objects: dict[str, bytes], mac: str) -> int:
    """Push one part to ``d`` as the ring's daemon ``sender`` does (``Replication._push``):
    signed with the ring's peer key, carrying uid 0 (the binding ``d`` holds). The seal's status."""
    conn = DaemonConnection(d.url, TOKEN)
    conn.peer = (PEER_KEY.encode(), sender)
    try:
        body = {k: head[k] for k in ("step", "attempt")} | {"root": root, "kind": "memory_only", "uid": 0}
        body |= {"ranks": [head["rank"]], "mac": mac}
        body["objects"] = [{"key": k, "size": len(v), "crc32c": crc32c(v)} for k, v in objects.items()]
        status, _, raw = conn.fetch("POST", "/v1/tiers/replicas", body)
        assert status == 200, raw
        rid = json.loads(raw)["replica"]
        for k, v in objects.items():
            status, _, raw = conn.fetch("PUT", f"/v1/tiers/replicas/{rid}?key={quote(k, safe='')}&offset=0", v)
            assert status == 200, raw
        return conn.fetch("POST", f"/v1/tiers/replicas/{rid}/seal", {})[0]
    finally:
        conn.close()


def test_a_replica_not_maced_for_the_roots_binding_is_refused(tmp_path):
    forged = _forged_parts(tmp_path)
    root, a, b, urls, out = _ring_saved(tmp_path)
    sealed = []
    try:
        for head, objs in forged:
            objects = {k: v for (k, _, _), v in zip(head["objects"], objs, strict=True)}
            try:  # a daemon of the ring's MAC, but for the root bound to bob
                from ckptd.server.replication import part_mac

                mac = part_mac(PEER_KEY.encode(), root, BOB, FORGED, head["attempt"], head["rank"], objects)
            except ImportError:  # the code before parts carried MACs
                mac = "0" * 64
            sealed.append(_push(a, urls[1], root, head, objects, mac))
        _restore(a, root, out, LAST)  # step 3, bitwise: never the forged step 5
        assert sealed == [400] * len(forged), sealed
        logs = a.logs()
        assert logs.count(f"replica from {urls[1]} refused") == len(forged), logs
        assert logs.count("not made by a daemon of this ring for that root bound to uid 0") == len(forged), logs
    finally:
        a.kill()
        b.kill()


def test_a_compromised_daemon_makes_a_memory_only_step_its_ring_restores(tmp_path):
    """What the MAC does not stop (docs/security.md, "What a compromised daemon can do"): whoever
    holds the ring's peer key derives the part key of the root's real binding (uid 0 here), so
    the same forged parts, MACed for it, are held at their seal and the victim's restore returns
    them: step 5, the other job's weights. Kept as a test so the docs' limit stays true."""
    from ckptd.server.replication import part_mac

    forged = _forged_parts(tmp_path)
    root, a, b, urls, out = _ring_saved(tmp_path)
    try:
        sealed = []
        for head, objs in forged:
            objects = {k: v for (k, _, _), v in zip(head["objects"], objs, strict=True)}
            mac = part_mac(PEER_KEY.encode(), root, 0, FORGED, head["attempt"], head["rank"], objects)
            sealed.append(_push(a, urls[1], root, head, objects, mac))
        assert sealed == [200] * len(forged), (sealed, a.logs())
        args = {"daemon": a.socket_url, "root": root, "ref": str(out / f"ref_step{LAST}.pt")}
        procs = launch.spawn(2, "restore_position", args, out / "r", {"CKPTD_TOKEN": TOKEN}, scenarios=SCENARIOS)
        res = launch.wait(procs, out / "r", "restore_position", timeout=600)
        assert [r["step"] for r in res] == [FORGED] * 2 and any(r["mismatches"] for r in res), res
    finally:
        a.kill()
        b.kill()
