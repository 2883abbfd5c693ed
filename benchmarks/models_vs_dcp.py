"""What PyTorch DCP does on the cases of issue 16, next to ckptd (not part of the test suite).

    PYTHONPATH=$PWD python benchmarks/models_vs_dcp.py [OUT_DIR]

The same models, training and checks as the gallery (``tests/distributed/model_scenarios.py``):
GPT-2 (tied), BERT (unused pooler), T5 (bf16, shared embeddings), Llama (FSDP2 mixed
precision), a BatchNorm CNN (DDP, compiled at save). Each is trained 2 steps at 2 ranks and
saved twice: with ``Checkpointer.save`` and with ``dcp.save`` of ``get_state_dict`` (the
recipe of the DCP tutorial, schedulers and scaler as extra entries). Both are restored at 3
ranks and at 1 process -- DCP with ``get_state_dict`` + ``dcp.load`` + ``set_state_dict`` -- and
compared bitwise with the state at save (rank 0's replica for buffers). Then, at 1 process:
restoring only the model from the full checkpoint; the BERT checkpoint through DCP with
``allow_partial_load`` (past its planner's refusal); and an error while applying (a GradScaler
saved disabled, restored enabled); each failure with whether it changed the model. Prints one line per case and system.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tests.distributed import launch
from tests.distributed import model_scenarios as ms
from trainer_hooks import Checkpointer

ARCHS = list(ms.ARCHS)
SCENARIOS = "benchmarks.models_vs_dcp"


def _err(e: BaseException) -> str:
    if isinstance(e, KeyboardInterrupt | SystemExit):
        raise e
    failures = getattr(e, "failures", None)  # DCP's CheckpointException: per rank, the error
    if failures:
        rank, f = sorted(failures.items())[0]
        inner = f[0] if isinstance(f, tuple) else getattr(f, "exc", f)  # (exception, frames)
        return f"{type(e).__name__} (rank {rank}: {type(inner).__name__}: {str(inner).splitlines()[0][:300]})"
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"


def _dcp_state(state: dict) -> dict:
    msd, osd = get_state_dict(state["model"], state["optim"])
    sd = {"model": msd, "optim": osd}
    for k in ("sched", "scaler"):
        if k in state:
            sd[k] = state[k].state_dict()
    return sd


def _dcp_apply(state: dict, sd: dict) -> None:
    set_state_dict(state["model"], state["optim"], model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    for k in ("sched", "scaler"):
        if k in state:
            state[k].load_state_dict(sd[k])


def save_both(root: str, out: str, archs: list[str]) -> dict:
    res = {}
    for arch in archs:
        state = ms.make(arch, seed=0, compiled=True)
        for s in range(2):
            ms.train_step(arch, state, s)
        with Checkpointer(f"{root}/ckptd/{arch}") as ck:
            ck.save(1, state).result()
        dcp.save(_dcp_state(state), checkpoint_id=f"{root}/dcp/{arch}")
        ms.record(arch, state, out)
        res[arch] = {"replicas_differ": ms.differing_replicas(state), "stateless": ms.stateless(state)}
    return res


def restore_both(root: str, out: str, archs: list[str], ref_ws: int, compiled: bool = False) -> dict:
    res = {}
    for arch in archs:
        res[arch] = {}
        state = ms.make(arch, seed=7, compiled=compiled)
        try:
            with Checkpointer(f"{root}/ckptd/{arch}") as ck:
                ck.restore(state)
            res[arch]["ckptd"] = ms.compare(arch, state, out, ref_ws)
        except BaseException as e:  # noqa: BLE001 - reported: this script compares (DCP's error is a BaseException)
            res[arch]["ckptd"] = [_err(e)]
        state = ms.make(arch, seed=7, compiled=compiled)
        try:
            sd = _dcp_state(state)
            dcp.load(sd, checkpoint_id=f"{root}/dcp/{arch}")
            _dcp_apply(state, sd)
            res[arch]["dcp"] = ms.compare(arch, state, out, ref_ws)
        except BaseException as e:  # noqa: BLE001
            res[arch]["dcp"] = [_err(e)]
    return res


def one_process_cases(root: str, out: str) -> dict:
    """A subset restore, and an error while applying, at one process (the CNN)."""
    res = {}
    model = ms.make("cnn", seed=7)["model"]
    try:
        with Checkpointer(f"{root}/ckptd/cnn") as ck:
            ck.restore({"model": model})
        res["subset ckptd"] = "ok"
    except BaseException as e:  # noqa: BLE001
        res["subset ckptd"] = _err(e)
    try:
        msd, _ = get_state_dict(model, [])
        dcp.load({"model": msd}, checkpoint_id=f"{root}/dcp/cnn")
        set_state_dict(model, [], model_state_dict=msd, optim_state_dict={})
        res["subset dcp"] = "ok"
    except BaseException as e:  # noqa: BLE001
        res["subset dcp"] = _err(e)

    # The pooler without AdamW state, past DCP's planner: allow_partial_load lets dcp.load fill
    # what the checkpoint has (in place), then set_state_dict meets the parameter with no state.
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    state = ms.make("bert", seed=7)
    try:
        sd = _dcp_state(state)
        dcp.load(sd, checkpoint_id=f"{root}/dcp/bert", planner=DefaultLoadPlanner(allow_partial_load=True))
        _dcp_apply(state, sd)
        outcome = "no error"
    except BaseException as e:  # noqa: BLE001
        outcome = _err(e)
    pooler = state["model"].bert.pooler.dense.weight
    got = {
        k: (v.tolist() if v.numel() == 1 else f"all zero: {bool((v == 0).all())}")
        for k, v in state["optim"].state.get(pooler, {}).items()
    }
    res["pooler dcp allow_partial_load"] = (
        f"{outcome}; parameters without optimizer state after it: {ms.stateless(state)} "
        f"(at save: ['bert.pooler.dense.bias', 'bert.pooler.dense.weight']); pooler.dense.weight's state: {got}"
    )

    state = ms.make("cnn", seed=0)
    state["scaler"] = torch.amp.GradScaler("cpu", enabled=False)
    ms.train_step("cnn", state, 0)
    with Checkpointer(f"{root}/apply/ckptd") as ck:
        ck.save(0, state).result()
    dcp.save(_dcp_state(state), checkpoint_id=f"{root}/apply/dcp")
    for system in ("ckptd", "dcp"):
        new = ms.make("cnn", seed=7)  # an enabled scaler: its load_state_dict refuses an empty state
        before = {k: v.clone() for k, v in new["model"].state_dict().items()}
        try:
            if system == "ckptd":
                with Checkpointer(f"{root}/apply/ckptd") as ck:
                    ck.restore(new)
            else:
                sd = _dcp_state(new)
                dcp.load(sd, checkpoint_id=f"{root}/apply/dcp")
                _dcp_apply(new, sd)
            outcome = "no error"
        except BaseException as e:  # noqa: BLE001
            outcome = _err(e)
        changed = [k for k, v in new["model"].state_dict().items() if not torch.equal(v, before[k])]
        res[f"apply error {system}"] = f"{outcome}; model tensors changed by the failed restore: {len(changed)}"
    return res


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="models_vs_dcp_"))
    root = str(out / "ck")
    kw = {"scenarios": SCENARIOS, "timeout": 900, "root": root}
    saved = launch.run(2, "save_both", out, archs=ARCHS, **kw)[0]
    print("at save (2 ranks):")
    for arch in ARCHS:
        print(
            f"  {arch}: replicas that differ between ranks {saved[arch]['replicas_differ']}, "
            f"parameters without optimizer state {saved[arch]['stateless']}"
        )
    for ws, compiled in ((3, False), (1, True)):
        got = launch.run(ws, "restore_both", out, archs=ARCHS, ref_ws=2, compiled=compiled, **kw)[0]
        print(f"restore at {ws} {'process' if ws == 1 else 'ranks'} (CNN {'compiled' if compiled else 'uncompiled'}):")
        for arch in ARCHS:
            for system in ("ckptd", "dcp"):
                bad = got[arch][system]
                print(f"  {arch:6s} {system:6s} {'bitwise' if not bad else 'DIFFERS/FAILS: ' + json.dumps(bad)}")
    extra = launch.run(1, "one_process_cases", out, **kw)[0]
    print("one process:")
    for k, v in extra.items():
        print(f"  {k}: {v}")


if __name__ == "__main__":
    main()
