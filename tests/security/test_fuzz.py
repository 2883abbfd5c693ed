"""Bounded fuzzing (hypothesis) of everything ckptd reads from outside: manifests, zarr.json,
commit and done records, typed-JSON values, CLI arguments and the daemon's request bodies.

Properties: no traceback (only ``CheckpointError`` from the API; exit 0/1/2 and one error line
from the CLI), no 5xx from the daemon, no file touched outside the job root, and memory bounded
(the CLI campaign runs in a subprocess under ``RLIMIT_AS``). Each campaign is small
(``max_examples``) so the whole file takes a minute or two; raise ``CKPTD_FUZZ_EXAMPLES`` for a
longer run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptd import jsonenc
from ckptd.errors import CheckpointError
from tests.security.conftest import REPO, env, make_root

pytestmark = pytest.mark.timeout(600)

N = int(os.environ.get("CKPTD_FUZZ_EXAMPLES", "40"))
STEP = "step_0000000001"
SETTINGS = settings(
    max_examples=N,
    deadline=None,
    derandomize=True,  # deterministic in CI: the same examples every run
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)

TAGS = ["$tensor", "$tuple", "$dict", "$np", "$ndarray", "$bytes", "$float", "$dtype"]
_leaf = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([10**30, -1, 0, 1, 2**63, 1e308, -0.0])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from(
        ["$tensor", "$tuple", "$dict", "$np", "$ndarray", "$bytes", "$float", "$dtype", "float32", "model/w"]
    )
)
JSON = st.recursive(
    _leaf,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.text(max_size=8)
            | st.sampled_from(["$tensor", "$np", "$ndarray", "$tuple", "$dict", "$bytes", "kind", "data", "shape"]),
            inner,
            max_size=4,
        )
    ),
    max_leaves=20,
)


def _mutate(doc, path: list[int], value):
    """Replace the node reached by following ``path`` (indices into each container's items)."""
    if not path or not isinstance(doc, dict | list) or not doc:
        return value
    items = list(doc.items()) if isinstance(doc, dict) else list(enumerate(doc))
    k, v = items[path[0] % len(items)]
    out = dict(doc) if isinstance(doc, dict) else list(doc)
    out[k] = _mutate(v, path[1:], value)
    return out


MUTATION = st.tuples(st.lists(st.integers(0, 50), max_size=6), JSON)
TARGETS = ["manifest.json", "commit.json", "zarr.json", "arrays/model/w/zarr.json", "_done"]


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


def campaign(base: str, examples: int) -> None:
    """The CLI campaign (run under RLIMIT_AS by the test below): mutate one JSON object of a
    real checkpoint, run the read-only commands and ``gc --dry-run`` in this process."""
    from ckptd.cli.main import main

    base_path = Path(base)
    pristine, outside = base_path / "pristine", base_path / "outside"
    before = _files(outside)

    @settings(SETTINGS, max_examples=examples)
    @given(target=st.sampled_from(TARGETS), mutation=MUTATION, argv=st.sampled_from(["ls", "show", "verify", "gc"]))
    def run(target, mutation, argv):
        root = base_path / "root"
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(pristine, root, symlinks=True)
        done = target == "_done"
        path = next((root / STEP / "_done").rglob("*.json")) if done else root / STEP / target
        doc = _mutate(json.loads(path.read_text()), *mutation)
        path.write_text(json.dumps(doc))
        args = [argv, str(root)] + (["--keep-last", "1", "--dry-run"] if argv == "gc" else [])
        rc = main(args)
        assert rc in (0, 1), (args, rc)

    run()
    assert _files(outside) == before, "a file outside the job root changed"


def test_cli_campaign_memory_bounded(tmp_path):
    make_root(tmp_path / "pristine", steps=(1,))
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "keep").write_text("x")
    # A link from the root to outside: nothing may follow it.
    os.symlink(tmp_path / "outside", tmp_path / "pristine" / STEP / "arrays" / "evil")
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (1536 << 20, 1536 << 20))\n"
        "from tests.security.test_fuzz import campaign\n"
        f"campaign({str(tmp_path)!r}, {N})\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code], env=env(), cwd=str(REPO), capture_output=True, text=True, timeout=500
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]


@SETTINGS
@given(JSON)
def test_typed_json_decode_only_raises_checkpoint_error(value):
    with contextlib.suppress(CheckpointError):  # the one error type; any other fails
        jsonenc.decode(value, on_tensor=lambda key: key)


@SETTINGS
@given(
    st.lists(
        st.sampled_from(
            [
                "ls",
                "show",
                "verify",
                "gc",
                "reshard",
                "export",
                "--step",
                "--json",
                "--keep-last",
                "--to",
                "--format",
                "torch",
                "dcp",
                "-1",
                "0",
                "1",
                "99999999999",
                "1e9",
                "\u0661",
                "--dry-run",
                "x" * 300,
                "",
                "--",
                "-h",
            ]
        ),
        max_size=6,
    )
)
def test_cli_arguments_never_traceback(argv):
    from ckptd.cli.main import main

    root = tempfile.mkdtemp(prefix="ckptd-fuzz-args-")
    try:
        args = [root if a == "x" * 300 else a for a in argv]
        if args and args[0] == "export":
            args = [*args, os.path.join(root, "out")]
        try:
            rc = main(args)
        except SystemExit as e:  # only --help may exit through argparse here
            rc = e.code
        assert rc in (0, 1, 2), (args, rc)
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ------------------------------------------------------------------------------ the daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    from tests.server.daemon import Daemon

    base = tmp_path_factory.mktemp("fuzz-daemon")
    root = make_root(base / "jobs", steps=(1,))
    # A tampered root the daemon lists: a hostile manifest and commit record.
    (root / "step_0000000002").mkdir()
    (root / "step_0000000002" / "commit.json").write_text("[" * 100000)
    (root / "step_0000000002" / "manifest.json").write_text('{"format": "ckptd", "tensors": 5}')
    with Daemon([str(root)], base / "stg", base / "d.log") as d:
        yield d, str(root)


BODY = st.fixed_dictionaries(
    {},
    optional={
        "lease": st.text(max_size=20) | st.integers(),
        "root": st.text(max_size=20) | st.just("ROOT"),
        "step": st.integers(-5, 10**12) | st.text(max_size=4),
        "attempt": st.text(max_size=10),
        "rank": st.integers(-2, 5),
        "world_size": st.integers(-2, 5),
        "bytes": st.integers(-10, 10**20),
        "client": st.text(max_size=5),
        "shards": st.lists(JSON, max_size=3),
        "metadata": st.lists(JSON, max_size=3),
        "done": JSON,
        "keep_last": JSON,
    },
)


@SETTINGS
@given(path=st.sampled_from(["/v1/leases", "/v1/jobs", "/v1/roots/check"]), body=BODY, raw=st.booleans())
def test_daemon_bodies_never_5xx(daemon, path, body, raw):
    d, root = daemon
    body = {k: (root if v == "ROOT" else v) for k, v in body.items()}
    with d.client() as c:
        if raw:
            r = c.post(path, content=json.dumps(body).encode()[::-1], headers={"content-type": "application/json"})
        else:
            r = c.post(path, json=body)
        assert r.status_code < 500, (path, body, r.status_code, r.text)
        if r.status_code == 200 and path == "/v1/leases":
            c.delete(f"/v1/leases/{r.json()['lease']}")


def test_daemon_deep_bodies_and_tampered_root(daemon):
    d, root = daemon
    with d.client() as c:
        deep = "[" * 100_000 + "]" * 100_000
        r = c.post("/v1/jobs", content=deep, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, r.text
        lease = c.post("/v1/leases", json={"root": root, "rank": 0, "bytes": 8, "client": "t"}).json()
        head = {"lease": lease["lease"], "root": root, "step": 9, "attempt": "a1", "rank": 0, "world_size": 1}
        for depth in (100, 5000):  # deeper than the done check allows; deeper than json.dumps goes
            nested = '{"a":' * depth + "{}" + "}" * depth
            body = json.dumps({**head, "shards": [], "metadata": []})[:-1] + f', "done": {nested}}}'
            r = c.post("/v1/jobs", content=body, headers={"content-type": "application/json"})
            assert 400 <= r.status_code < 500, (depth, r.status_code, r.text)
        for path in (
            "/v1/checkpoints",
            "/v1/checkpoints/2",
            "/v1/checkpoints/1",
            "/v1/checkpoints/99999999999",
            "/v1/checkpoints/-1",
            "/v1/status",
            "/",
        ):
            r = c.get(path, params={"root": root})
            assert r.status_code < 500 or r.status_code == 502, (path, r.status_code, r.text)
            assert r.status_code != 500, (path, r.text)
        assert c.get("/healthz").status_code == 200


# ------------------------------------------------------------- torch-free readers (issue 27)

CHUNK = f"{STEP}/arrays/model/w/c/0/0"
BYTES_MUTATION = st.tuples(
    st.sampled_from(["flip", "truncate", "append", "replace"]), st.integers(0, 1 << 12), st.binary(max_size=64)
)
READER_TARGETS = [
    "arrays/model/w/zarr.json",
    "arrays/model/big/zarr.json",
    "arrays/model/zarr.json",
    "zarr.json",
    "manifest.json",
    "chunk",
    "shard",
]


def _mutate_bytes(data: bytes, how: str, at: int, extra: bytes) -> bytes:
    at = at % (len(data) + 1)
    if how == "flip":
        return data[:at] + bytes([data[at] ^ 0x5A]) + data[at + 1 :] if at < len(data) else data + b"\0"
    if how == "truncate":
        return data[:at]
    if how == "append":
        return data + extra
    return data[:at] + extra + data[at + len(extra) :]


def _reader_state() -> dict:
    import torch

    g = torch.Generator().manual_seed(3)  # "big" is sharded: 15 inner chunks and an index
    return {"model": {"w": torch.randn(16, 8, generator=g), "big": torch.randn(300, 1000, generator=g)}}


@pytest.fixture(scope="module")
def pristine_reader_root(tmp_path_factory):
    from trainer_hooks import Checkpointer

    root = tmp_path_factory.mktemp("fuzz-open") / "pristine"
    ckpt = Checkpointer(str(root))
    try:
        ckpt.save(1, _reader_state()).result()
    finally:
        ckpt.close()
    return root


@SETTINGS
@given(
    target=st.sampled_from(READER_TARGETS),
    json_mutation=MUTATION,
    bytes_mutation=BYTES_MUTATION,
    how=st.sampled_from(["array", "group"]),
    key=st.sampled_from(["model/w", "model/big"]),
)
def test_open_array_and_open_group_on_mutated_files_raise_only_checkpoint_error(
    pristine_reader_root, target, json_mutation, bytes_mutation, how, key
):
    import numpy as np

    import ckptd

    want = _reader_state()["model"][key.split("/")[1]].numpy()
    with tempfile.TemporaryDirectory(prefix="ckptd-fuzz-open-") as tmp:
        root = Path(tmp) / "root"
        shutil.copytree(pristine_reader_root, root, symlinks=True)
        if target in ("chunk", "shard"):
            path = root / (CHUNK if target == "chunk" else CHUNK.replace("model/w", "model/big"))
            data = path.read_bytes()
            at = bytes_mutation[1] * (97 if target == "shard" else 1)  # reach the index too
            path.write_bytes(_mutate_bytes(data, bytes_mutation[0], at, bytes_mutation[2]))
        else:
            path = root / STEP / target
            path.write_text(json.dumps(_mutate(json.loads(path.read_text()), *json_mutation)))
        try:
            if how == "array":
                got = np.asarray(ckptd.open_array(str(root), key).read().result())
            else:
                got = np.asarray(ckptd.open_group(str(root))[f"arrays/{key}"][...])
        except CheckpointError:
            return  # the one error type; anything else fails the test
        # Read without an error: then they are the saved values, never others.
        assert got.shape == want.shape and np.array_equal(got, want), (target, json_mutation, bytes_mutation)


# ------------------------------------------------------------------ the _latest chain (issue 27)

CHAIN_VALUE = (
    JSON.map(lambda v: json.dumps(v).encode())
    | st.integers(-(2**40), 2**40).map(lambda n: str(n).encode())
    | st.sampled_from([b"", b"[" * 5000, b"9" * 11, b"9999999999", b"2", b"1", b"3", b"0", b"4 ", b"1e3", b"true"])
    | st.binary(max_size=32)
)
CHAIN_KEYS = ["hint.json", "first.json", "after_0000000001.json", "after_0000000002.json", "after_0000000003.json"]


@pytest.fixture(scope="module")
def pristine_chain_root(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz-chain")
    return make_root(base / "pristine", steps=(1, 2, 3))


@SETTINGS
@given(edits=st.lists(st.tuples(st.sampled_from(CHAIN_KEYS), st.none() | CHAIN_VALUE), min_size=1, max_size=5))
def test_a_mutated_latest_chain_never_changes_the_restored_step(pristine_chain_root, edits):
    import torch

    from trainer_hooks import Checkpointer

    with tempfile.TemporaryDirectory(prefix="ckptd-fuzz-chain-") as tmp:
        root = Path(tmp) / "root"
        shutil.copytree(pristine_chain_root, root, symlinks=True)
        for name, value in edits:  # None: the object deleted (a dropped link)
            path = root / "_latest" / name
            path.unlink(missing_ok=True)
            if value is not None:
                path.write_bytes(value)
        state = {"model": {"w": torch.zeros(16, 8), "b": torch.zeros(8)}, "meta": {"epoch": -1}}
        ckpt = Checkpointer(str(root))
        try:
            assert ckpt.latest_step() == 3, edits
            assert ckpt.restore(state) == 3 and state["meta"]["epoch"] == 3, edits
            ckpt.save(4, {"model": {"w": torch.ones(16, 8), "b": torch.ones(8)}, "meta": {"epoch": 4}}).result()
            assert ckpt.latest_step() == 4, edits
        finally:
            ckpt.close()


# -- forged claims (issue 27 item 5): whatever a root writer plants under a step's _claims/, a
# claim either goes through (and then the claimant really owns the step) or is one CheckpointError;
# a claim dated past, in the future or stamped with absurd numbers never blocks the step for good.

CLAIM_NAME = (
    st.sampled_from(["000000.json", "000001.json", "999999.json", "1000000.json", "000002.json"])
    | (st.integers(min_value=0, max_value=10**18).map(lambda n: f"{n:06d}.json"))
    | st.sampled_from(["x.json", "0000001.json", "-00001.json", "000001.jsonx", "alive"])
)
CLAIM_BODY = (
    JSON.map(lambda v: json.dumps(v).encode())
    | st.fixed_dictionaries(
        {
            "writer": st.sampled_from(["other-job", "fuzz-job", "", 7]),
            "attempt": st.sampled_from(["a1", "a2", "", None]),
            "time": st.sampled_from([0, -1, 1e12, 4e9, 1e308, "now"]),
            "lease": st.sampled_from([0, -5, 1e300, 60, "x"]),
        }
    ).map(lambda d: json.dumps(d).encode())
    | st.binary(max_size=64)
)
# file times: far past, far future (10 years), now; None keeps the write's own time
CLAIM_MTIME = st.none() | st.sampled_from([0.0, 1.0, 315_360_000.0, -315_360_000.0])


@SETTINGS
@given(planted=st.lists(st.tuples(CLAIM_NAME, CLAIM_BODY, CLAIM_MTIME), min_size=1, max_size=6))
def test_forged_claims_give_a_claim_or_one_checkpoint_error(planted):
    import time as _time

    from ckptd import claims
    from ckptd.errors import StepClaimed
    from storage_backends import open_store

    with tempfile.TemporaryDirectory(prefix="ckptd-fuzz-claims-") as tmp:
        folder = Path(tmp) / "root" / "step_0000000002" / "_claims"
        folder.mkdir(parents=True)
        for name, body, shift in planted:
            path = folder / name
            path.write_bytes(body)
            if shift is not None:  # a forged file time: this far from now (0.0: the epoch)
                t = shift if shift in (0.0, 1.0) else _time.time() + shift
                os.utime(path, (t, t))
        with open_store(str(Path(tmp) / "root")) as store:
            try:
                claims.begin(store, 2, "fuzz-attempt", "fuzz-job")
            except StepClaimed as e:
                # refused only for a claim that looks alive, and never with a negative age
                ages = re.findall(r"(?:last write|last heartbeat|written) (-?[\d.e+]+) s ago", str(e))
                assert ages and all(float(a) >= 0 for a in ages), str(e)
            except CheckpointError:
                pass
            else:
                rec = claims.owner(store, 2)
                assert rec is not None and rec.get("attempt") == "fuzz-attempt", (planted, rec)
