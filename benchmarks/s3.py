"""S3 rows: ckptd save/restore against raw boto3 moving the same bytes, on the loopback moto
server (section ``s3``) and on a real Ceph RADOS Gateway on loopback (section ``rgw``:
``tests.rgwserver``, a one-node cluster with a memstore OSD; needs Debian's ``radosgw ceph-mon
ceph-osd``, skipped without them).

The floor is plain boto3 moving the same bytes as 16 MiB objects on 16 threads (ckptd's S3
part size and worker count), PUT and GET in parallel: the fastest way to move them through one
client. (A single multipart object is no floor: moto serves one far more slowly than many small
objects, which would hide ckptd's own overhead.) moto is a correctness server on the same cores
as the client: its figures measure moto, not S3. RGW is Ceph's own gateway (C++), closer to
what a real object store costs per request, though it too shares the machine's cores.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from benchmarks import state as st
from benchmarks.common import Timer, collect, rotate
from benchmarks.results import ERROR, Results

SECTION = "s3"
PART = 16 << 20
THREADS = 16


@contextlib.contextmanager
def endpoint_env(url: str, credentials: dict):
    """The AWS_* variables pointing at ``url`` with ``credentials`` (restored afterwards)."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("AWS_") or k in ("NO_PROXY", "no_proxy")}
    try:
        for k in [k for k in os.environ if k.startswith("AWS_")]:
            del os.environ[k]
        os.environ.update(credentials)
        os.environ.update(
            AWS_ENDPOINT_URL=url,
            AWS_EC2_METADATA_DISABLED="true",
            AWS_CONFIG_FILE=os.devnull,
            AWS_SHARED_CREDENTIALS_FILE=os.devnull,
        )
        for k in ("NO_PROXY", "no_proxy"):
            os.environ[k] = ",".join(filter(None, [saved.get(k), "127.0.0.1", "localhost"]))
        yield url
    finally:
        for k in [k for k in os.environ if k.startswith("AWS_") or k in ("NO_PROXY", "no_proxy")]:
            del os.environ[k]
        os.environ.update(saved)


@contextlib.contextmanager
def moto_env():
    """A moto server and the AWS_* variables pointing at it."""
    from tests.s3server import CREDENTIALS, start_moto_server, stop

    proc, url = start_moto_server()
    try:
        with endpoint_env(url, CREDENTIALS):
            yield url
    finally:
        stop(proc)


@contextlib.contextmanager
def rgw_env(device_bytes: int = 1 << 30):
    """A one-node Ceph cluster's RADOS Gateway and the AWS_* variables pointing at it; its OSD
    holds ``device_bytes`` (every byte written: RGW frees deleted objects only hours later)."""
    from tests import rgwserver

    missing = rgwserver.missing_binaries()
    if missing:
        raise RuntimeError(
            f"Ceph is not installed ({', '.join(missing)} missing: apt-get install radosgw ceph-mon ceph-osd)"
        )
    server = rgwserver.start_rgw_server(device_bytes=device_bytes)
    try:
        with endpoint_env(server.url, rgwserver.CREDENTIALS):
            yield server.url
    finally:
        rgwserver.stop(server)


SERVERS = {"s3": ("moto", moto_env), "rgw": ("Ceph RGW", rgw_env)}


def run(
    res: Results,
    size: int,
    reps: int,
    selected: Callable[[str], bool],
    profile_prefix: str | None = None,
    section: str = SECTION,
):
    """The rows of ``section``: ``s3`` on moto, ``rgw`` on Ceph's gateway (``SERVERS``)."""
    import boto3

    from trainer_hooks import Checkpointer

    def R(id, label, floor=None, unit="s"):  # noqa: N802
        return res.row(f"{section}.{id}", section, label, floor=floor and f"{section}.{floor}", unit=unit)

    server, env = SERVERS[section]
    R("floor.put", f"boto3 PUT of the state's bytes as 16 MiB objects, 16 threads, {server} (floor)")
    R("floor.get", f"boto3 GET of those objects, 16 threads, into a preallocated buffer, {server} (floor)")
    R("ckptd.save", f"ckptd save to S3 ({server}): until committed", floor="floor.put")
    R("ckptd.block", f"ckptd save to S3 ({server}): time save() blocks")
    R("ckptd.restore", f"ckptd restore from S3 ({server})", floor="floor.get")
    sec = res.sections.setdefault(section, {})
    try:
        # every save and floor write of the run, with room (RGW does not free deletes in time)
        ctx = env() if env is moto_env else env(device_bytes=(3 * reps + 6) * size + (1 << 30))
        url = ctx.__enter__()
    except Exception as e:  # noqa: BLE001 - the server is an external process
        for r in res.rows.values():
            if r.section == section:
                r.status, r.note = ERROR, f"{server} did not start: {e}"[:2000]
        return
    try:
        _run(res, size, reps, url, sec, boto3, Checkpointer, profile_prefix, section)
    finally:
        ctx.__exit__(None, None, None)
        collect()


def _run(res, size, reps, url, sec, boto3, Checkpointer, profile_prefix, section):  # noqa: N803
    from botocore.config import Config

    model, optim, dims = st.build_local(size, seed=3)
    state = {"model": model, "optim": optim}
    tensors = st.all_tensors(model, optim)
    total = st.nbytes(tensors)
    sec.update({"state_bytes": total, "model": st.describe(dims), "endpoint": url, "reps": reps})
    flat = torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in tensors])
    blob = memoryview(flat.numpy())
    parts = [bytes(blob[o : o + PART]) for o in range(0, total, PART)]  # outside any timing
    out = bytearray(total)
    out_mv = memoryview(out)
    # The raw rows use the client settings ckptd's store uses: a CRC32 on every body and no
    # SHA-256 of the payload (which botocore would add over moto's plain http).
    # A session of its own: boto3's default session keeps the credentials it first resolved
    # (the moto section's), which the RGW section's endpoint refuses (InvalidAccessKeyId).
    client = boto3.session.Session().client(
        "s3", config=Config(max_pool_connections=THREADS * 2, s3={"payload_signing_enabled": False})
    )
    bucket = f"ckptd-bench-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    pool = ThreadPoolExecutor(THREADS)
    ck = Checkpointer(f"s3://{bucket}/job")
    step = [0]
    sent = st.sentinel(model)
    ref = sent.detach().clone()

    def floor_put(rep: int) -> None:
        with Timer() as t:
            list(pool.map(lambda i: client.put_object(Bucket=bucket, Key=f"obj/{i}", Body=parts[i]), range(len(parts))))
        res.add(f"{section}.floor.put", rep, t.s)

    def floor_get(rep: int) -> None:
        with Timer() as t:

            def one(i: int) -> None:
                off = i * PART
                data = client.get_object(Bucket=bucket, Key=f"obj/{i}")["Body"].read()
                out_mv[off : off + len(data)] = data

            list(pool.map(one, range(len(parts))))
        res.add(f"{section}.floor.get", rep, t.s)

    def ckptd_save(rep: int) -> None:
        step[0] += 1
        t0 = time.perf_counter()
        fut = ck.save(step[0], state)
        block = time.perf_counter() - t0
        fut.result()
        t = time.perf_counter() - t0
        from ckptd import catalog

        for s in catalog.steps(ck.store):  # untimed: the raw rows delete nothing either
            if s < step[0]:
                catalog.delete_checkpoint(ck.store, s)
        if rep >= 0:
            res.add(f"{section}.ckptd.block", rep, block)
            res.add(f"{section}.ckptd.save", rep, t)

    def ckptd_restore(rep: int) -> None:
        with torch.no_grad():
            sent.zero_()
        with Timer() as t:
            ck.restore(state)
        res.add(f"{section}.ckptd.restore", rep, t.s)
        if not torch.equal(sent.detach(), ref):
            res.notes.append("S3: ckptd restore brought back different values")

    try:
        ckptd_save(-1)  # warm-up: snapshot buffers, connections
        saves, reads = [floor_put, ckptd_save], [floor_get, ckptd_restore]
        for rep in range(reps):
            for phase in (saves, reads):
                for f in rotate(phase, rep):
                    f(rep)
                    collect()
        if profile_prefix:
            from benchmarks.profiling import profiled

            with profiled(profile_prefix + "_save", "ckptd save to S3 (moto), block + commit") as p:
                ckptd_save(-2)
            sec.setdefault("profiles", {})["save"] = p
            with profiled(profile_prefix + "_restore", "ckptd restore from S3 (moto)") as p:
                ckptd_restore(-2)
            sec["profiles"]["restore"] = p
            res.rows[f"{section}.ckptd.restore"].values.pop(-2, None)
    finally:
        ck.close()
        pool.shutdown()
        with contextlib.suppress(Exception):
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
                objs = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                if objs:
                    client.delete_objects(Bucket=bucket, Delete={"Objects": objs, "Quiet": True})
            client.delete_bucket(Bucket=bucket)
        client.close()
