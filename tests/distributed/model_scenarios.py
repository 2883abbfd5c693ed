"""The gallery's ranks: real architectures built from ``transformers`` configs, and a BatchNorm
CNN, trained a few steps, saved, restored. Run by ``launch.py`` (``scenarios=`` this module).

Every model is tiny and its dimensions divide unevenly by the world sizes used (2, 3): a
vocabulary of 37, hidden sizes of 35 or 40, feed-forward sizes of 37, 5 and 7 channels. Each
architecture carries one of the cases real jobs meet:

- ``gpt2``: GPT-2 with ``wte`` tied to ``lm_head``, FSDP2, AdamW + ``LambdaLR``;
- ``bert``: BERT whose pooler the loss never reaches (no AdamW state for ``pooler.dense.*``),
  FSDP2, ``SequentialLR``;
- ``t5``: T5 with its embeddings shared by encoder, decoder and head, held in bfloat16;
- ``llama``: Llama (RMSNorm, rotary, SwiGLU, grouped KV heads) under FSDP2
  ``MixedPrecisionPolicy(param_dtype=bfloat16)``: fp32 master weights;
- ``cnn``: convolutions + BatchNorm under DDP, each rank on its own data (its running
  statistics differ between ranks), ``torch.compile``d (dynamo, eager backend) when asked, with
  a ``GradScaler``.

Results are JSON; references (the full state at save, gathered on rank 0) are ``torch.save``
files in ``out``.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from trainer_hooks import Checkpointer

ARCHS = ("gpt2", "bert", "t5", "llama", "cnn")
VOCAB, SEQ, BATCH, TAGS, CLASSES = 37, 7, 6, 5, 7

logging.getLogger("transformers").setLevel(logging.ERROR)
# FSDP2's note on modules that return views: these models do no in-place op on their outputs.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


def world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


class BertTagger(nn.Module):
    """Token tagging on BERT's sequence output: its pooler gets no gradient, ever."""

    def __init__(self):
        super().__init__()
        from transformers import BertConfig, BertModel

        cfg = BertConfig(
            vocab_size=VOCAB + 4,
            hidden_size=35,
            num_hidden_layers=2,
            num_attention_heads=5,
            intermediate_size=37,
            max_position_embeddings=16,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            pad_token_id=0,
        )
        self.bert = BertModel(cfg, add_pooling_layer=True)
        self.head = nn.Linear(35, TAGS)

    def forward(self, x):
        return self.head(self.bert(input_ids=x).last_hidden_state)


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 5, 3), nn.BatchNorm2d(5)
        self.c2, self.b2 = nn.Conv2d(5, 7, 3), nn.BatchNorm2d(7)
        self.fc = nn.Linear(7, CLASSES)

    def forward(self, x):
        h = torch.relu(self.b1(self.c1(x)))
        h = torch.relu(self.b2(self.c2(h)))
        return self.fc(h.mean(dim=(2, 3)))


def _model(arch: str) -> tuple[nn.Module, list[nn.Module]]:
    """The bare model and the submodules FSDP2 shards separately (the root is sharded too)."""
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        T5Config,
        T5ForConditionalGeneration,
    )

    ids = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    if arch == "gpt2":
        m = GPT2LMHeadModel(
            GPT2Config(
                vocab_size=VOCAB,
                n_positions=16,
                n_embd=35,
                n_layer=2,
                n_head=5,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                **ids,
            )
        )
        return m, list(m.transformer.h)
    if arch == "bert":
        m = BertTagger()
        return m, list(m.bert.encoder.layer)
    if arch == "t5":
        m = T5ForConditionalGeneration(
            T5Config(
                vocab_size=VOCAB,
                d_model=35,
                d_kv=7,
                num_heads=5,
                d_ff=37,
                num_layers=1,
                num_decoder_layers=1,
                dropout_rate=0.0,
                decoder_start_token_id=0,
                **ids,
            )
        ).to(torch.bfloat16)
        return m, [*m.encoder.block, *m.decoder.block]
    if arch == "llama":
        m = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=VOCAB,
                hidden_size=40,
                intermediate_size=37,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=16,
                **ids,
            )
        )
        return m, list(m.model.layers)
    if arch == "cnn":
        return ConvNet(), []
    raise ValueError(arch)


def make(arch: str, seed: int, compiled: bool = False) -> dict:
    """The training state of ``arch`` at this world size: FSDP2 (DDP for the CNN) with more
    than one rank, the bare model with one."""
    rank, ws = world()
    torch.manual_seed(seed)
    model, blocks = _model(arch)
    if arch == "cnn":
        if compiled:
            model = torch.compile(model, backend="eager")
        if ws > 1:
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model)
    elif ws > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (ws,))
        kw = {}
        if arch == "llama":
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for b in blocks:
            fully_shard(b, mesh=mesh, **kw)
        fully_shard(model, mesh=mesh, **kw)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    state = {"model": model, "optim": optim}
    if arch == "gpt2":
        state["sched"] = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + s))
    elif arch == "bert":
        warm = torch.optim.lr_scheduler.LinearLR(optim, start_factor=0.5, total_iters=2)
        decay = torch.optim.lr_scheduler.ExponentialLR(optim, gamma=0.9)
        state["sched"] = torch.optim.lr_scheduler.SequentialLR(optim, [warm, decay], milestones=[2])
    elif arch == "cnn":
        state["scaler"] = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    return state


def _batch(arch: str, step: int):
    rank, ws = world()
    g = torch.Generator().manual_seed(1000 + step)
    if arch == "cnn":
        x, y = torch.randn(BATCH, 3, 9, 9, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)
    else:
        x = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
        y = torch.randint(0, TAGS, (BATCH, SEQ), generator=g) if arch == "bert" else x
    return x[rank::ws].contiguous(), y[rank::ws].contiguous()


def train_step(arch: str, state: dict, step: int) -> float:
    model, optim = state["model"], state["optim"]
    x, y = _batch(arch, step)
    if arch == "bert":
        loss = nn.functional.cross_entropy(model(x).reshape(-1, TAGS), y.reshape(-1))
    elif arch == "cnn":
        loss = nn.functional.cross_entropy(model(x), y)
    else:
        loss = model(input_ids=x, labels=y).loss
    optim.zero_grad()
    if "scaler" in state:
        state["scaler"].scale(loss).backward()
        state["scaler"].step(optim)
        state["scaler"].update()
    else:
        loss.backward()
        optim.step()
    if "sched" in state:
        state["sched"].step()
    t = loss.detach().float().clone()
    if dist.is_initialized():
        dist.all_reduce(t)
        t /= dist.get_world_size()
    return float(t)


def eval_loss(arch: str, state: dict) -> float:
    """The loss in eval mode on one fixed batch, as rank 0 computes it. Collective. In eval
    mode BatchNorm normalises with its running statistics, which a training step's loss never
    reads (it uses the batch's): this is the loss that sees whether they are the ones the
    uninterrupted job holds. Under DDP each rank evaluates its own replica, as DDP does under
    ``no_grad``; rank 0's is DDP's broadcast source, so its value is the one reported."""
    rank, ws = world()
    model = _bare(state["model"]) if arch == "cnn" else state["model"]
    g = torch.Generator().manual_seed(999)
    if arch == "cnn":
        x, y = torch.randn(BATCH, 3, 9, 9, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)
    else:
        x = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
        y = torch.randint(0, TAGS, (BATCH, SEQ), generator=g) if arch == "bert" else x
    model.eval()
    with torch.no_grad():
        if arch == "bert":
            loss = nn.functional.cross_entropy(model(x).reshape(-1, TAGS), y.reshape(-1))
        elif arch == "cnn":
            loss = nn.functional.cross_entropy(model(x), y)
        else:
            loss = model(input_ids=x, labels=y).loss
    model.train()
    t = loss.detach().float().clone()
    if dist.is_initialized():
        dist.broadcast(t, 0)
    return float(t)


def full_state(state: dict) -> dict:
    """Every parameter, buffer and optimizer state as full CPU tensors on rank 0 (collective)."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model, optim = state["model"], state["optim"]
    out = {f"model/{k}": v for k, v in get_model_state_dict(model, options=opts).items()}
    for fqn, s in get_optimizer_state_dict(model, optim, options=opts).get("state", {}).items():
        for k, v in s.items():
            out[f"optim/{fqn}/{k}"] = v if isinstance(v, torch.Tensor) else torch.tensor(v)
    return out


def objects(state: dict) -> dict:
    """The scheduler's and scaler's state dicts, as JSON text (functions dropped)."""
    return {
        k: json.dumps(state[k].state_dict(), sort_keys=True, default=repr) for k in ("sched", "scaler") if k in state
    }


def _bare(model: nn.Module) -> nn.Module:
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model


def ties(arch: str, state: dict) -> list[str]:
    """Which tied weights are no longer one parameter."""
    m = _bare(state["model"])
    pairs = {
        "gpt2": [("transformer.wte.weight", "lm_head.weight")],
        "t5": [
            ("shared.weight", "encoder.embed_tokens.weight"),
            ("shared.weight", "decoder.embed_tokens.weight"),
            ("shared.weight", "lm_head.weight"),
        ],
    }.get(arch, [])
    return [f"{a} and {b} are not one parameter" for a, b in pairs if m.get_parameter(a) is not m.get_parameter(b)]


def stateless(state: dict) -> list[str]:
    """The parameters the optimizer holds no state for, by name."""
    optim = state["optim"]
    return sorted(n for n, p in _bare(state["model"]).named_parameters() if p not in optim.state)


def record(arch: str, state: dict, out: str) -> None:
    rank, ws = world()
    ref = full_state(state)
    if rank == 0:
        torch.save(ref, Path(out) / f"ref_{arch}_{ws}.pt")
        Path(out, f"ref_{arch}_{ws}.json").write_text(
            json.dumps({"objects": objects(state), "stateless": stateless(state)})
        )


def differing_replicas(state: dict) -> list[str]:
    """The model's plain (replicated) tensors whose values differ between ranks. Collective."""
    sd = get_model_state_dict(state["model"])
    mine = {k: v.detach().clone() for k, v in sd.items() if type(v) is torch.Tensor}
    if not dist.is_initialized():
        return []
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [k for k, v in mine.items() if not all(torch.equal(v, o[k]) for o in everyone)]


def compare(arch: str, state: dict, out: str, ref_ws: int) -> list[str]:
    """Everything that differs from the reference saved at ``ref_ws`` (rank 0 reports): every
    tensor bitwise (dtype, shape, bits), the schedulers' and scaler's state, which parameters
    have no optimizer state, tied weights, and replicas that disagree across ranks."""
    got = full_state(state)
    bad = ties(arch, state) + [f"{k} differs between ranks" for k in differing_replicas(state)]
    if world()[0] != 0:
        return bad
    expect = torch.load(Path(out) / f"ref_{arch}_{ref_ws}.pt")
    meta = json.loads(Path(out, f"ref_{arch}_{ref_ws}.json").read_text())
    if set(expect) != set(got):
        bad.append(f"keys differ: {sorted(set(expect) ^ set(got))}")
    for k in sorted(set(expect) & set(got)):
        a, b = expect[k], got[k]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            bad.append(k)
    if objects(state) != meta["objects"]:
        bad.append(f"objects differ: {objects(state)} != {meta['objects']}")
    if stateless(state) != meta["stateless"]:
        bad.append(f"parameters without optimizer state: {stateless(state)} != {meta['stateless']}")
    return bad


def _restore(arch: str, root: str, out: str, ref_ws: int, compiled: bool) -> dict:
    state = make(arch, seed=7, compiled=compiled)
    with Checkpointer(f"{root}/{arch}") as ck:
        step = ck.restore(state)
    bad = compare(arch, state, out, ref_ws)
    ev = eval_loss(arch, state)
    return {"step": step, "mismatches": bad, "eval_loss": ev, "next_loss": train_step(arch, state, step + 1)}


def gallery_save(root: str, out: str, archs: list[str], steps: int = 2) -> dict:
    """Per architecture: train ``steps`` steps, save, record the reference, train one more step
    (the uninterrupted run's next loss); then, in the same processes, restore into a fresh state
    at this world size and train that step again."""
    res = {}
    for arch in archs:
        state = make(arch, seed=0, compiled=True)
        losses = [train_step(arch, state, s) for s in range(steps)]
        differ = differing_replicas(state)
        with Checkpointer(f"{root}/{arch}") as ck:
            ck.save(steps - 1, state).result()
        record(arch, state, out)
        res[arch] = {
            "losses": losses,
            "stateless": stateless(state),
            "replicas_differ": differ,
            "eval_loss": eval_loss(arch, state),
            "next_loss": train_step(arch, state, steps),
            "same_size": _restore(arch, root, out, world()[1], compiled=True),
        }
    return res


def gallery_restore(root: str, out: str, archs: list[str], ref_ws: int, compiled: bool = False) -> dict:
    """Per architecture: restore the checkpoint saved at ``ref_ws`` ranks at this world size,
    compare with the reference, train one step."""
    return {arch: _restore(arch, root, out, ref_ws, compiled) for arch in archs}
