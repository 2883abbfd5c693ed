"""Bytes that vouch for themselves (issue 36 item 3).

The attack: crc32c is linear, so 4 bytes chosen by a little GF(2) algebra make any contents keep
a chunk's crc32c. Here a committed, pinned step's shard object is rewritten in storage: one
chunk's values become 666.0 except 4 compensating bytes, so its stored crc32c (and the crc32c
pinned in the done record) still match. Before BLAKE3 pins, ``restore`` returned 666.0 and
``ckptd verify`` passed; now both refuse the step naming the object, and ``restore(fallback=True)``
returns the previous step bitwise. Steps whose done records pin no BLAKE3 (written before it)
still restore and verify, against their crc32c pins as before.
"""

from __future__ import annotations

import json
import logging
import struct

import numpy as np
import pytest
import torch

from ckptd import catalog, codec, persist
from ckptd.cli.main import main
from storage_backends import open_store
from trainer_hooks import Checkpointer, CorruptChunkError

SHAPE = (512, 1024)  # 2 MiB of float32: a sharded object of several chunks
SHARD = "arrays/w/c/0/0"
KEY = f"step_0000000002/{SHARD}"


def value(step: int) -> torch.Tensor:
    return torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).reshape(SHAPE) * step


def forge(body: bytes, want: bytes, at: int) -> bytes:
    """``want`` (as long as ``body``) with the 4 bytes at ``at`` replaced so that its crc32c is
    ``body``'s: crc32c(x) is affine in x over GF(2), so flipping bit i of those 4 bytes flips a
    fixed 32-bit pattern of the crc; solve for the flips by Gaussian elimination."""
    target = codec.crc32c(body)
    base = bytearray(want)
    base[at : at + 4] = bytes(4)
    c0 = codec.crc32c(bytes(base))
    cols = []
    for i in range(32):
        b = bytearray(base)
        b[at : at + 4] = struct.pack("<I", 1 << i)
        cols.append(codec.crc32c(bytes(b)) ^ c0)
    # rows: (column effects as a 32-bit mask, the bit of x it stands for) -- eliminate over GF(2)
    rows = [(cols[i], 1 << i) for i in range(32)]
    need, x = target ^ c0, 0
    basis: dict[int, tuple[int, int]] = {}
    for eff, bit in rows:
        for hb in sorted(basis, reverse=True):
            if eff >> hb & 1:
                eff, bit = eff ^ basis[hb][0], bit ^ basis[hb][1]
        if eff:
            basis[eff.bit_length() - 1] = (eff, bit)
    for hb in sorted(basis, reverse=True):
        if need >> hb & 1:
            need, x = need ^ basis[hb][0], x ^ basis[hb][1]
    assert need == 0, "the 32 bits span every crc (crc32c's map is invertible)"
    base[at : at + 4] = struct.pack("<I", x)
    assert codec.crc32c(bytes(base)) == target
    return bytes(base)


def forge_chunk(root: str, k: int = 1) -> None:
    """Rewrite chunk ``k`` of step 2's shard to 666.0 (and 4 compensating bytes) in place."""
    store = open_store(root)
    layout = catalog.load_manifest(store, 2).tensors["w"].layout
    data = bytearray(store.get(KEY))
    n = layout.chunk_nbytes
    off = k * (n + codec.CRC_BYTES)
    body = bytes(data[off : off + n])
    evil = np.full(n // 4, 666.0, np.float32).tobytes()
    forged = forge(body, evil, n - 4)  # the chunk's last element carries the compensation
    assert forged != body and codec.crc32c(forged) == codec.crc32c(body)
    data[off : off + n] = forged
    store.put(KEY, bytes(data))


def test_a_chunk_forged_to_keep_its_crc32c_is_refused(tmp_path, capsys):
    root = str(tmp_path / "job")
    with Checkpointer(root) as ck:
        ck.save(1, {"w": value(1)}).result()
        ck.save(2, {"w": value(2)}).result()
    forge_chunk(root)

    rc = main(["verify", root, "--step", "2"])
    out = capsys.readouterr()
    assert rc == 1, out
    assert SHARD in out.out + out.err and "BLAKE3" in out.out + out.err and "Traceback" not in out.err

    got = {"w": torch.zeros(SHAPE)}
    with Checkpointer(root) as ck:
        with pytest.raises(CorruptChunkError, match=f"{SHARD}.*BLAKE3"):
            ck.restore(got, step=2)
        assert not (got["w"] == 666.0).any()  # a failed restore leaves the state as it was
        assert ck.restore(got, fallback=True) == 1
    assert torch.equal(got["w"], value(1))


def test_a_corrupt_chunk_still_reads_as_corrupt(tmp_path):
    """The BLAKE3 check stands for the crc32c on restore: accidental corruption is reported as
    before (crc32c mismatch), not as a forgery."""
    root = str(tmp_path / "job")
    with Checkpointer(root) as ck:
        ck.save(2, {"w": value(2)}).result()
    store = open_store(root)
    data = bytearray(store.get(KEY))
    data[100] ^= 1
    store.put(KEY, bytes(data))
    with Checkpointer(root) as ck, pytest.raises(CorruptChunkError, match="crc32c mismatch"):
        ck.restore({"w": torch.zeros(SHAPE)}, step=2)


def test_steps_pinned_without_blake3_still_restore_and_verify(tmp_path, monkeypatch):
    """A done record written before issue 36 (``v`` 1: size and crc32c per part) is read as then."""
    monkeypatch.setattr(persist, "shard_digests", lambda bufs: None)
    monkeypatch.setattr(persist, "image_digests", lambda *a: None)
    root = str(tmp_path / "job")
    with Checkpointer(root) as ck:
        ck.save(2, {"w": value(2)}).result()
    store = open_store(root)
    (rec_key,) = [o.key for o in store.list("step_0000000002/_done/") if "/t1/" in o.key]
    pins = json.loads(store.get(rec_key))["pins"]
    assert pins["v"] == 1 and all(len(p) == 2 for p in pins["shards"].values())
    monkeypatch.undo()
    assert main(["verify", root, "--step", "2"]) == 0
    got = {"w": torch.zeros(SHAPE)}
    with Checkpointer(root) as ck:
        assert ck.restore(got, step=2) == 2
    assert torch.equal(got["w"], value(2))


def test_a_hot_replica_forged_to_keep_its_crc32c_is_not_restored(tmp_path, monkeypatch, caplog):
    """The issue's attack on a peer: whoever signs with the ring's peer key (a compromised daemon)
    pushes a hot replica of committed step 2 into a daemon, its chunk rewritten to 666.0 with 4
    compensating bytes (the object's and the chunk's crc32c as pinned). A restore through that
    daemon reads the step from its memory tier: the BLAKE3 pin refuses the chunk (one WARNING
    naming the shard), and the restore ends with step 2's own values (the root's bytes), never
    666.0. With crc32c pins only, it returned 666.0 from the tier."""
    import hashlib
    import hmac
    import os
    import time
    import urllib.parse
    import urllib.request

    from tests import load
    from tests.distributed import launch
    from tests.server.daemon import PEER_KEY, node

    token = tmp_path / "token"
    token.write_text("forged-crc-token-0123456789")
    os.chmod(token, 0o600)
    monkeypatch.setenv("CKPTD_TOKEN_FILE", str(token))
    sender = "http://127.0.0.1:9"  # the peer the compromised key speaks for
    root = f"file://{tmp_path / 'job'}"
    with Checkpointer(root) as ck:  # steps 1 and 2 committed in the root
        ck.save(1, {"w": value(1)}).result()
        ck.save(2, {"w": value(2)}).result()
    store = open_store(root)
    attempt = catalog.read_commit(store, 2)["attempt"]
    layout = catalog.load_manifest(store, 2).tensors["w"].layout
    data = bytearray(store.get(KEY))
    n, off = layout.chunk_nbytes, layout.chunk_nbytes + codec.CRC_BYTES  # chunk 1
    evil = np.full(n // 4, 666.0, np.float32).tobytes()
    data[off : off + n] = forge(bytes(data[off : off + n]), evil, n - 4)
    forged = bytes(data)

    def call(url: str, method: str, path: str, body: bytes) -> int:
        when, nonce = str(int(time.time())), os.urandom(16).hex()
        msg = "\n".join([method, path, hashlib.sha256(body).hexdigest(), when, nonce, sender])
        mac = hmac.new(PEER_KEY.encode(), msg.encode(), hashlib.sha256).hexdigest()
        req = urllib.request.Request(url + path, data=body, method=method)
        req.add_header("Authorization", f"Bearer {token.read_text()}")
        req.add_header("Content-Type", "application/json")
        req.add_header("X-Ckptd-Peer", f"{sender} {when} {nonce} {mac}")
        with urllib.request.urlopen(req, timeout=load.scaled(10)) as r:
            out = r.read()
            return json.loads(out)["replica"] if path == "/v1/tiers/replicas" else r.status

    port = launch.free_port()
    d = node(tmp_path, "b", root, port, [f"http://127.0.0.1:{port}", sender])
    try:
        body = {"root": root, "step": 2, "attempt": attempt, "ranks": [0], "kind": "hot"}
        body["objects"] = [{"key": KEY, "size": len(forged), "crc32c": codec.crc32c(forged)}]
        rid = call(d.url, "POST", "/v1/tiers/replicas", json.dumps(body).encode())
        assert call(d.url, "PUT", f"/v1/tiers/replicas/{rid}?key={urllib.parse.quote(KEY, safe='')}&offset=0", forged)
        assert call(d.url, "POST", f"/v1/tiers/replicas/{rid}/seal", b"{}") == 200
        got = {"w": torch.zeros(SHAPE)}
        caplog.set_level(logging.WARNING, logger="trainer_hooks")
        with Checkpointer(root, daemon=d.socket_url) as ck:
            assert ck.restore(got) == 2
            read = ck.last_restore_tiers
        assert torch.equal(got["w"], value(2)), read  # never the forged chunk (666.0 throughout)
        assert read["root"] > 0, read  # the refused shard came from the root
        refused = [r.getMessage() for r in caplog.records if "BLAKE3" in r.getMessage()]
        assert len(refused) == 1 and SHARD in refused[0], caplog.text  # logged once
    finally:
        d.kill()
