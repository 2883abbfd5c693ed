"""The elastic deploy recipes cannot run here (no Slurm, no cluster): lint them. The YAML has the
fields the recipe depends on, the shell parses (``bash -n``), and every torchrun, ``ckptd`` and
training-script flag in them is one that the real parsers accept."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from torch.distributed.run import get_args_parser

from ckptd.cli.main import build_parser

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "deploy" / "slurm" / "elastic.sbatch"
JOB = REPO / "deploy" / "k8s" / "elastic-job.yaml"

pytestmark = pytest.mark.timeout(60)


def train_parser():
    spec = importlib.util.spec_from_file_location("train_elastic", REPO / "examples" / "train_elastic.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.parse_args


def expand(script: str) -> str:
    """Joins continued lines and gives shell variables values (their ``${VAR:-default}`` where
    the script has one), so that shlex can split the command lines."""
    defaults = dict(re.findall(r"^([A-Z_]+)=\$\{\1:-([^}]*)\}", script, flags=re.MULTILINE))
    script = script.replace("\\\n", " ")
    script = re.sub(r"\$\(\([^)]*\)\)", "8", script)
    return re.sub(r"\$\{?([A-Z_]+)\}?", lambda m: defaults.get(m[1], "4"), script)


def command_line(script: str, program: str) -> list[str]:
    """The arguments of ``program`` on the first (non-comment) line that runs it."""
    for line in expand(script).splitlines():
        if line.lstrip().startswith("#"):
            continue
        words = shlex.split(line)
        if program in words:
            words = words[words.index(program) + 1 :]
            return words[:-1] if words[-1] == "&" else words
    raise AssertionError(f"no line runs {program}")


def check_torchrun_and_script(script: str) -> tuple:
    torchrun = get_args_parser().parse_args(command_line(script, "torchrun"))
    assert torchrun.training_script == "examples/train_elastic.py"
    args = train_parser()(torchrun.training_script_args)
    assert args.root and args.every > 0
    reshard = build_parser().parse_args(["reshard", *command_line(script, "reshard")])
    assert reshard.command == "reshard" and reshard.to
    return torchrun, args


def test_sbatch_parses_and_has_the_stop_requeue_reshard_cycle():
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    text = SBATCH.read_text()
    assert text.startswith("#!/bin/bash\n")
    directives = dict((m[1], m[2]) for m in re.finditer(r"^#SBATCH --([a-z-]+)(?:=(\S+))?", text, flags=re.MULTILINE))
    assert re.fullmatch(r"B:USR1@(\d+)", directives["signal"])
    notice = int(directives["signal"].split("@")[1])
    assert "requeue" in directives and directives["open-mode"] == "append"
    assert re.fullmatch(r"\d+-\d+", directives["nodes"]), "a node-count range, so a restart may get another size"
    assert "trap on_usr1 USR1" in text and 'scancel --signal=TERM "$SLURM_JOB_ID"' in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text  # torchrun restarts: see the comment there
    assert 'ckptd reshard "$CKPT_ROOT" --to "$NEW_WORLD"' in text
    assert text.index("ckptd reshard") < text.index("srun ")  # reshard before the ranks start
    torchrun, _ = check_torchrun_and_script(text)
    shutdown = int(re.search(r"SHUTDOWN_TIMEOUT:-(\d+)", text)[1])
    assert shutdown < notice, "torchrun must not SIGKILL the ranks before the notice period ends"


def test_k8s_job_recipe_fields():
    docs = [d for d in yaml.safe_load_all(JOB.read_text()) if d]
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"Service", "Job"}
    svc, job = kinds["Service"], kinds["Job"]
    assert job["apiVersion"] == "batch/v1" and svc["apiVersion"] == "v1"
    name = job["metadata"]["name"]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {"job-name": name}

    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == svc["metadata"]["name"]
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy requires it
    rules = spec["podFailurePolicy"]["rules"]
    assert any(r["action"] == "Ignore" and {"type": "DisruptionTarget"} in r.get("onPodConditions", []) for r in rules)
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert spec["parallelism"] == spec["completions"] == int(env["NNODES"])

    assert container["command"] == ["bash", "-c"]
    (script,) = container["args"]
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    assert "exec torchrun" in script, "torchrun must be PID 1 to receive the pod's SIGTERM"
    assert script.index("ckptd reshard") < script.index("exec torchrun")
    assert '"$JOB_COMPLETION_INDEX" = 0' in script  # only pod 0 reshards
    torchrun, _ = check_torchrun_and_script(script)
    assert torchrun.node_rank == 4  # "$JOB_COMPLETION_INDEX", as expand() fills it in
    assert torchrun.master_addr == f"{name}-0.{svc['metadata']['name']}"
    assert torchrun.master_port == svc["spec"]["ports"][0]["port"]
    assert torchrun.shutdown_timeout < pod["terminationGracePeriodSeconds"]


def test_k8s_resize_command_from_the_readme_changes_all_three_lines():
    text = JOB.read_text()
    assert len(re.findall(r"# NNODES$", text, flags=re.MULTILINE)) == 3
    # sed -E '/# NNODES/ s/[0-9]+/3/': the first number on each marked line
    resized = "\n".join(
        re.sub(r"[0-9]+", "3", ln, count=1) if re.search(r"# NNODES$", ln) else ln for ln in text.splitlines()
    )
    job = next(d for d in yaml.safe_load_all(resized) if d and d["kind"] == "Job")
    env = {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert job["spec"]["parallelism"] == job["spec"]["completions"] == int(env["NNODES"]) == 3
    assert "sed -E '/# NNODES/ s/[0-9]+/3/'" in (REPO / "deploy" / "README.md").read_text()
