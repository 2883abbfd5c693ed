"""Tier rows: a restore after a node loss from a peer daemon's memory, side by side with the
same restore from the job root on local disk, from the loopback moto S3 server, and ``dcp.load``.

Three real daemons on loopback play three nodes (ring ``--peers a,b,c``, one replica): the
state is saved through daemon ``a``, whose hot copy is replicated to ``b``; then ``a`` is
SIGKILLed (the node is lost) and a rank on node ``c`` (whose daemon holds nothing) restores
through ``c``: every chunk comes from ``b``'s memory over HTTP (checked: 0 chunk bytes from the
root), the manifest from the job root. The other rows restore the same state with the default
``Checkpointer`` from a local-disk root and from an S3 root on moto, and with ``dcp.load`` from
local disk. Systems are interleaved per repetition (``rotate``) and reported as median ratios to
the S3 restore (the issue's target: the peer restore at most 0.3x of it). One rank restores
(M=1) in the first rows; the ``tiers.m{M}.*`` rows (``RANKS``, default M=2) save an FSDP2 state
at M ranks and restore it at M ranks on node ``c`` (``benchmarks.tier_scenarios``), each
restore's time the slowest rank's. Two floors run in the same rotation: ``tiers.memcpy`` (the
state's bytes copied into preallocated tensors, the faster of ``copy_`` per tensor and
``hostcopy.copy_all``; the local row is judged against it) and
``tiers.socket`` (the same bytes sent by a thread over a TCP loopback connection, received with
``recv_into`` into a preallocated buffer; the peer row is judged against it). The
``tiers.mem{M}.*`` rows (``MEM_RANKS``, default 1,2,3) restore at M ranks on one node a
memory-only step (``persist_every`` > 1: it lives only in the daemon's memory) beside the
hot-copy restore of a committed step of the same state. moto and the daemons share the
machine's cores with the clients.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from benchmarks import state as st
from benchmarks.common import Timer, collect, rotate
from benchmarks.results import ERROR, Results

SECTION = "tiers"
RANKS = tuple(int(m) for m in os.environ.get("CKPTD_BENCH_TIER_RANKS", "2").split(",") if m.strip())
MEM_RANKS = tuple(int(m) for m in os.environ.get("CKPTD_BENCH_MEMSTEP_RANKS", "1,2,3").split(",") if m.strip())
TOKEN = "bench-tier-token-" + uuid.uuid4().hex


def run(res: Results, size: int, reps: int, bench_dir: str) -> None:
    def R(id, label, floor=None):  # noqa: N802
        return res.row(id, SECTION, label, floor=floor)

    R("tiers.s3", "ckptd restore from the job root on S3 (loopback moto)")
    R("tiers.peer", "ckptd restore after a node loss from a peer daemon's memory", floor="tiers.s3")
    R("tiers.local", "ckptd restore from this node's daemon's memory (sealed memfd, mapped)", floor="tiers.s3")
    R("tiers.disk", "ckptd restore from the job root on local disk", floor="tiers.s3")
    R("tiers.dcp", "dcp.load from local disk", floor="tiers.s3")
    R("tiers.silent", "ckptd restore from this node's daemon's memory, a peer SIGSTOPped", floor="tiers.local")
    R("tiers.memcpy", "memcpy floor: the state's bytes copied into preallocated tensors", floor="tiers.s3")
    R("tiers.socket", "socket floor: the state's bytes over a TCP loopback socket into a preallocated buffer",
      floor="tiers.s3")  # fmt: skip
    for m in MEM_RANKS:
        at = f"at {m} rank{'s' if m > 1 else ''}"
        R(f"tiers.mem{m}.hot", f"{at}: ckptd restore of a committed step from the node daemon's hot copy")
        R(
            f"tiers.mem{m}.memonly",
            f"{at}: ckptd restore of a memory-only step (persist_every > 1) from the node daemon",
            floor=f"tiers.mem{m}.hot",
        )
    for m in RANKS:
        R(f"tiers.m{m}.s3", f"at {m} ranks: ckptd restore from the job root on S3 (loopback moto)")
        R(
            f"tiers.m{m}.peer",
            f"at {m} ranks: ckptd restore after a node loss from a peer's memory",
            floor=f"tiers.m{m}.s3",
        )
        R(f"tiers.m{m}.disk", f"at {m} ranks: ckptd restore from the job root on local disk", floor=f"tiers.m{m}.s3")
        R(f"tiers.m{m}.dcp", f"at {m} ranks: dcp.load from local disk", floor=f"tiers.m{m}.s3")
    sec = res.sections.setdefault(SECTION, {})
    from benchmarks.s3 import moto_env

    try:
        ctx = moto_env()
        url = ctx.__enter__()
    except Exception as e:  # noqa: BLE001 - the server is an external process
        for r in res.rows.values():
            if r.section == SECTION:
                r.status, r.note = ERROR, f"moto server did not start: {e}"
        return
    work = Path(tempfile.mkdtemp(prefix="tiers-", dir=bench_dir))
    saved_token = os.environ.get("CKPTD_TOKEN")
    os.environ["CKPTD_TOKEN"] = TOKEN
    try:
        _run(res, size, reps, work, url, sec)
        for m in RANKS:
            try:
                _run_m(res, size, reps, work / f"m{m}", m, sec)
            except Exception as e:  # noqa: BLE001 - a failed row is reported, not the whole run
                for k in ("s3", "peer", "disk", "dcp"):
                    res.rows[f"tiers.m{m}.{k}"].status, res.rows[f"tiers.m{m}.{k}"].note = ERROR, str(e)[:300]
        for m in MEM_RANKS:
            try:
                _run_memsteps(res, size, reps, work / f"mem{m}", m, sec)
            except Exception as e:  # noqa: BLE001 - a failed row is reported, not the whole run
                for k in ("hot", "memonly"):
                    res.rows[f"tiers.mem{m}.{k}"].status, res.rows[f"tiers.mem{m}.{k}"].note = ERROR, str(e)[:300]
    finally:
        if saved_token is None:
            os.environ.pop("CKPTD_TOKEN", None)
        else:
            os.environ["CKPTD_TOKEN"] = saved_token
        ctx.__exit__(None, None, None)
        shutil.rmtree(work, ignore_errors=True)
        collect()


def _run_m(res: Results, size: int, reps: int, work: Path, m: int, sec: dict) -> None:
    """The rows at ``m`` restoring ranks: save at ``m`` ranks through daemon a, SIGKILL a,
    restore at ``m`` ranks through c (every chunk from b's memory), disk, S3, dcp."""
    import boto3

    from benchmarks import dist

    work.mkdir(parents=True)
    bucket = f"ckptd-bench-tiers-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    args = {
        "size": size,
        "disk_root": str(work / "root"),
        "s3_root": f"s3://{bucket}/job",
        "dcp_dir": str(work / "dcp"),
    }
    daemons = _daemons(work, args["disk_root"], size)
    try:
        saved = dist.run(m, "benchmarks.tier_scenarios:save", work, daemon=daemons[0].socket_url, **args)
        _wait_replica(daemons[1], 1)
        daemons[0].kill()
        got = dist.run(m, "benchmarks.tier_scenarios:restore", work, daemon=daemons[2].socket_url, reps=reps, **args)
    finally:
        for d in daemons:
            d.stop()
    want = sum(r["checksum"] for r in saved)
    for name, times in got[0]["times"].items():
        for rep, t in enumerate(times):
            res.add(f"tiers.m{m}.{name}", rep, t)
        if abs(sum(r["checks"][name] for r in got) - want) > 1e-6 * max(1.0, abs(want)):
            res.notes.append(f"tiers: the {name} restore at {m} ranks brought back different values")
    tiers = {k: sum(r["tiers"].get(k, 0) for r in got) for k in ("local", "peer", "root")}
    sec[f"m{m}_peer_restore_tiers"] = tiers
    if tiers["peer"] == 0 or tiers["root"] != 0:
        res.notes.append(f"tiers: the peer restore at {m} ranks did not read everything from the peer: {tiers}")


def _run_memsteps(res: Results, size: int, reps: int, work: Path, m: int, sec: dict) -> None:
    """The memory-only step rows at ``m`` ranks on one node: a committed step (its hot copy in
    the node daemon) and a memory-only step of the same state (``persist_every`` > 1: only in
    the daemon's memory), each restored through that daemon, interleaved per repetition."""
    from benchmarks import dist

    work.mkdir(parents=True)
    hot_root, mem_root = f"file://{work / 'hot'}", f"file://{work / 'mem'}"
    # room for both roots' copies and the memory-only step's reservation (``memsteps.reserve_bytes``):
    # a daemon short of it persists the step instead, and the row would read from the root
    daemons = _daemons(work, [hot_root, mem_root], size, count=1, budget=8 * size + (512 << 20))
    try:
        got = dist.run(
            m,
            "benchmarks.tier_scenarios:memsteps",
            work,
            daemon=daemons[0].socket_url,
            hot_root=hot_root,
            mem_root=mem_root,
            size=size,
            reps=reps,
        )
    finally:
        for d in daemons:
            d.stop()
    for name, times in got[0]["times"].items():
        for rep, t in enumerate(times):
            res.add(f"tiers.mem{m}.{name}", rep, t)
        if any(r["checks"][name] != 1 for r in got):
            res.notes.append(f"tiers: the {name} restore at {m} ranks brought back different values")
    for name in ("hot", "memonly"):
        tiers = {k: sum(r["tiers"][name].get(k, 0) for r in got) for k in ("local", "peer", "root")}
        sec[f"mem{m}_{name}_restore_tiers"] = tiers
        if tiers["local"] == 0 or tiers["root"] != 0 or tiers["peer"] != 0:
            res.notes.append(f"tiers: the {name} restore at {m} ranks did not read everything from its daemon: {tiers}")
    if any(r["steps"] != {"hot": 1, "memonly": 3} for r in got):
        res.notes.append(f"tiers: the memory-only rows at {m} ranks restored other steps: {got[0]['steps']}")


def _daemons(work: Path, root: str | list[str], size: int, count: int = 3, budget: int | None = None) -> list:
    from tests.distributed import launch
    from tests.server.daemon import Daemon, peer_key_file

    (work / "token").write_text(TOKEN)
    os.chmod(work / "token", 0o600)
    ports = [launch.free_port() for _ in range(count)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    out = []
    for name, port, me in zip("abc"[:count], ports, urls, strict=True):
        d = Daemon(
            root if isinstance(root, list) else [root],
            work / f"staging-{name}",
            work / f"{name}.log",
            token_file=work / "token",
            CKPTD_PEERS=json.dumps(urls),
            CKPTD_ADVERTISE=me,
            CKPTD_PEER_KEY_FILE=str(peer_key_file(work)),
            CKPTD_BUDGET=str(budget or 4 * size + (256 << 20)),
        )
        out.append(d.start(port=port))
    return out


def _run(res: Results, size: int, reps: int, work: Path, url: str, sec: dict) -> None:
    import torch.distributed.checkpoint as dcp

    from trainer_hooks import Checkpointer
    from trainer_hooks.hostcopy import copy_all

    model, optim, dims = st.build_local(size, seed=3)
    state = {"model": model, "optim": optim}
    total = st.nbytes(st.all_tensors(model, optim))
    sec.update({"state_bytes": total, "model": st.describe(dims), "endpoint": url, "reps": reps, "ranks": 1})
    sent = st.sentinel(model)
    ref = sent.detach().clone()
    disk_root, dcp_dir = str(work / "root"), str(work / "dcp")
    daemons = _daemons(work, disk_root, size)
    try:
        with Checkpointer(disk_root, daemon=daemons[0].socket_url) as ck:
            ck.save(1, state).result()
        _wait_replica(daemons[1], 1)
        daemons[0].kill()  # node a is lost; b holds its replica
        import boto3

        bucket = f"ckptd-bench-tiers-{uuid.uuid4().hex[:12]}"
        boto3.client("s3").create_bucket(Bucket=bucket)
        s3_ck = Checkpointer(f"s3://{bucket}/job")
        s3_ck.save(1, state).result()
        dcp.save(st.dcp_state(model, optim), storage_writer=dcp.FileSystemWriter(dcp_dir))
        peer_ck = Checkpointer(disk_root, daemon=daemons[2].socket_url)
        local_ck = Checkpointer(disk_root, daemon=daemons[1].socket_url)  # a rank on node b, which holds it
        disk_ck = Checkpointer(disk_root)
        checked = {"peer_root_bytes": None}

        def restore(name: str, ck) -> None:
            with torch.no_grad():
                sent.zero_()
            with Timer() as t:
                ck.restore(state)
            res.add(f"tiers.{name}", rep_[0], t.s)
            if not torch.equal(sent.detach(), ref):
                res.notes.append(f"tiers: the {name} restore brought back different values")
            if name == "peer":
                tiers = ck.last_restore_tiers
                checked["peer_root_bytes"] = tiers.get("root")
                if tiers.get("peer", 0) == 0 or tiers.get("root", 1) != 0:
                    res.notes.append(f"tiers: the peer restore did not read everything from the peer: {tiers}")
            if name in ("local", "silent"):
                tiers = ck.last_restore_tiers
                if tiers.get("local", 0) == 0 or tiers.get("root", 1) != 0:
                    res.notes.append(f"tiers: the local restore did not read everything from its daemon: {tiers}")

        def dcp_load() -> None:
            with torch.no_grad():
                sent.zero_()
            with Timer() as t:
                sd = st.dcp_state(model, optim)
                dcp.load(sd, storage_reader=dcp.FileSystemReader(dcp_dir))
                st.dcp_apply(model, optim, sd)
            res.add("tiers.dcp", rep_[0], t.s)
            if not torch.equal(sent.detach(), ref):
                res.notes.append("tiers: dcp.load brought back different values")

        tensors = st.all_tensors(model, optim)
        dst = [torch.empty_like(t) for t in tensors]  # the floors' preallocated tensors

        copier = ThreadPoolExecutor(4, thread_name_prefix="floor-copy")

        def memcpy() -> None:
            # the faster of one copy_ per tensor (OpenMP inside, which stalls per tensor on a
            # busy machine) and the library's bulk copy (8 MiB pieces on 4 threads), as
            # inproc's floor.memcpy: a floor slowed by the load would flatter the ratio
            with Timer() as t:
                for d, s in zip(dst, tensors, strict=True):
                    d.copy_(s)
            with Timer() as t2:
                copy_all(list(zip(dst, tensors, strict=True)), copier)
            res.add("tiers.memcpy", rep_[0], min(t.s, t2.s))
            if not all(torch.equal(d, s) for d, s in zip(dst, tensors, strict=True)):
                res.notes.append("tiers: the memcpy floor copied different values")

        buf = torch.empty(total, dtype=torch.uint8)  # the socket floor's preallocated buffer

        def socket_copy() -> None:
            buf.zero_()
            with Timer() as t:
                got = _socket_copy(tensors, buf)
            res.add("tiers.socket", rep_[0], t.s)
            if got != total or not torch.equal(buf[-tail.numel() :], tail):
                res.notes.append("tiers: the socket floor received different bytes")

        tail = _bytes(tensors[-1]).clone()
        systems = [
            lambda: restore("peer", peer_ck),
            lambda: restore("local", local_ck),
            lambda: restore("disk", disk_ck),
            dcp_load,
            lambda: restore("s3", s3_ck),
            memcpy,
            socket_copy,
        ]
        rep_ = [-1]
        for f in systems:  # warm-up: connections, page cache, the floors' buffers faulted in
            f()
        for row in ("tiers.peer", "tiers.local", "tiers.disk", "tiers.dcp", "tiers.s3", "tiers.memcpy", "tiers.socket"):
            res.rows[row].values.clear()
        for rep in range(reps):
            rep_[0] = rep
            for f in rotate(systems, rep):
                f()
                collect()
        sec["peer_restore_root_chunk_bytes"] = checked["peer_root_bytes"]
        # A silent peer (stopped: its port accepts, nothing answers) beside the same local restore:
        # the restore asks it, gives it CKPTD_TIER_SURVEY_S and goes on without it.
        os.kill(daemons[2].proc.pid, signal.SIGSTOP)
        try:
            for rep in range(reps):
                rep_[0] = rep
                restore("silent", local_ck)
        finally:
            os.kill(daemons[2].proc.pid, signal.SIGCONT)
        for ck in (peer_ck, local_ck, disk_ck, s3_ck):
            ck.close()
        copier.shutdown()
    finally:
        for d in daemons:
            d.stop()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def _socket_copy(tensors: list[torch.Tensor], buf: torch.Tensor) -> int:
    """The socket floor: ``tensors``' bytes sent over a TCP loopback connection by a thread and
    received with ``recv_into`` into ``buf`` (preallocated); returns the bytes received."""
    import socket
    import threading

    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]

        def send() -> None:
            with socket.create_connection(("127.0.0.1", port)) as c:
                for t in tensors:
                    c.sendall(memoryview(_bytes(t).numpy()))

        th = threading.Thread(target=send, daemon=True)
        th.start()
        conn, _ = srv.accept()
        view, got = memoryview(buf.numpy()), 0
        with conn:
            while got < len(view):
                n = conn.recv_into(view[got:])
                if not n:
                    break
                got += n
        th.join()
    return got


def _wait_replica(d, step: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, body = d.get("/v1/tiers", TOKEN)
        if status == 200 and any(r["step"] == step and r["complete"] for r in body.get("replicas", [])):
            return
        time.sleep(0.05)
    raise RuntimeError(f"no replica of step {step} reached {d.url}:\n{d.logs()}")
