"""Real architectures come back exactly: GPT-2 (tied embeddings), BERT (a pooler the loss never
reaches), T5 (shared embeddings, bfloat16), Llama (FSDP2 mixed precision) and a BatchNorm CNN
(DDP, different data per rank, ``torch.compile``d), built from ``transformers`` configs with
dimensions that divide unevenly by 2 and 3 (see ``model_scenarios``).

Three launches serve every architecture: 2 ranks train, save, record the full state and take
one more step (the uninterrupted run), then restore into fresh objects and take that step again;
3 ranks and 1 process restore the same checkpoints. Every parameter, buffer and optimizer state
is compared bitwise with the state at save (rank 0's replica for buffers: DDP's broadcast
source), and so are the schedulers' and the GradScaler's state, which parameters have no
optimizer state, and which weights are tied. The CNN is compiled when saved at 2 ranks,
restored uncompiled at 3 and compiled again at 1.

No pretrained weights: no package installable here ships a ``transformers`` checkpoint (the
tiny test models live on the Hugging Face hub, which the tests may not download from).
"""

from __future__ import annotations

import pytest

from tests.distributed import launch

pytest.importorskip("transformers")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SCENARIOS = "tests.distributed.model_scenarios"
ARCHS = ["gpt2", "bert", "t5", "llama", "cnn"]
SAVED_AT = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("gallery")
    root = str(out / "ck")
    saved = launch.run(SAVED_AT, "gallery_save", out, timeout=600, scenarios=SCENARIOS, root=root, archs=ARCHS)
    at3 = launch.run(
        3, "gallery_restore", out, timeout=600, scenarios=SCENARIOS, root=root, archs=ARCHS, ref_ws=SAVED_AT
    )
    at1 = launch.run(
        1,
        "gallery_restore",
        out,
        timeout=600,
        scenarios=SCENARIOS,
        root=root,
        archs=ARCHS,
        ref_ws=SAVED_AT,
        compiled=True,
    )
    return {"saved": saved, 3: at3, 1: at1}


@pytest.mark.parametrize("arch", ARCHS)
def test_same_world_size_continues_exactly(runs, arch):
    ref = runs["saved"][0][arch]
    got = ref["same_size"]
    assert got["step"] == 1
    assert got["mismatches"] == [], got["mismatches"]
    # the eval loss reads BatchNorm's running statistics; the next step's loss the rest
    assert got["eval_loss"] == ref["eval_loss"]
    assert got["next_loss"] == ref["next_loss"]
    assert len({r[arch]["same_size"]["next_loss"] for r in runs["saved"]}) == 1


@pytest.mark.parametrize("world", [3, 1])
@pytest.mark.parametrize("arch", ARCHS)
def test_another_world_size_restores_bitwise(runs, arch, world):
    ref = runs["saved"][0][arch]
    got = runs[world][0][arch]
    assert got["step"] == 1
    assert got["mismatches"] == [], got["mismatches"]
    if arch != "cnn":  # BatchNorm normalises each rank's batch: another size, another loss
        assert got["next_loss"] == pytest.approx(ref["next_loss"], rel=2e-2 if arch == "t5" else 1e-4)
    assert len({r[arch]["next_loss"] for r in runs[world]}) == 1


def test_the_cases_are_real(runs):
    """The pooler really has no optimizer state at save, and BatchNorm's statistics really
    differ between the DDP ranks at save (so a replica other than rank 0's is wrong)."""
    assert runs["saved"][0]["bert"]["stateless"] == ["bert.pooler.dense.bias", "bert.pooler.dense.weight"]
    assert {"b1.running_mean", "b2.running_var"} <= set(runs["saved"][0]["cnn"]["replicas_differ"])
