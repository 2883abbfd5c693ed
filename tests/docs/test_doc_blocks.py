"""Every shell and Python block of README.md, docs/operations.md and deploy/README.md runs as
printed, one test per block (``test_block[FILE:LINE]``, the line of its opening fence).

The blocks of one section run in order in one scratch folder, with one environment: the
variables the README's "Running the examples" paragraph documents, pointed at this test's
scratch folder, free ports and a loopback S3 server (moto, bucket ``bucket``). A block made only
of ``ckptd serve`` commands is a daemon a user leaves running in a terminal: it keeps running
(answering ``/healthz`` and its socket) for the next blocks of its section and is stopped at
its end. Nothing in a block is rewritten. A runbook section presumes a job root in some state
(a corrupt step, a dead writer): ``scenarios.SETUP`` makes it with the real writer first.

The blocks that cannot run here are listed in ``NOT_HERE``, each with the reason and the check
that runs instead; a block of another language must be one of ``docblocks.NOT_RUN`` (output,
layouts, configuration), and one of those that reads like a command must be in ``SYNOPSES``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.docs import docblocks, scenarios
from tests.docs.docblocks import NOT_RUN, PYTHON, REPO, SHELL, Block, Section

DOCS = ("README.md", "docs/operations.md", "deploy/README.md")
ALL = [b for path in DOCS for b in docblocks.blocks(path)]
RUN = [b for b in ALL if b.lang in SHELL | PYTHON]

# Commands the docs say exit nonzero, by their exact text: the status they are allowed.
ALLOWED_FAILURES = {
    # "exit 1 if any is bad": the section's root has a corrupt step, as its title says
    'ckptd verify "$ROOT" --all': 1,
}

# Non-run blocks that read like commands: synopses with placeholders, not something to paste.
SYNOPSES = {
    ("README.md", "ckptd ls URI [--json]"): "the command-line synopsis (placeholders in capitals, options in brackets)",
}


def _ci_runs(*commands: str) -> None:
    """The block is what CI itself runs: `.ci/run` runs each of these commands."""
    ci = (REPO / ".ci" / "run").read_text()
    for c in commands:
        assert re.search(rf"^\s*(exec\s+|DS_BUILD_OPS=0\s+)?{re.escape(c)}", ci, re.M), f".ci/run does not run {c!r}"


def _k8s_manifests_exist(block: Block) -> None:
    for name in re.findall(r"deploy/k8s/[\w.-]+\.yaml", block.text):
        assert (REPO / name).is_file(), name


def _k8s_resize(block: Block) -> None:
    """The resize pipeline's own part, run for real: its output is the Job at 3 nodes, valid
    against the Kubernetes schemas (tests/systems/test_k8s.py validates the files as committed)."""
    import yaml

    sed = block.commands()[1].split("|")[0]
    out = subprocess.run(["bash", "-c", sed], cwd=REPO, capture_output=True, text=True, check=True).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    job = next(d for d in docs if d["kind"] == "Job")
    assert job["spec"]["parallelism"] == job["spec"]["completions"] == 3, job["spec"]
    if shutil.which("kubernetes-validate"):
        f = Path(tempfile.mkdtemp(prefix="ckptd-doc-k8s-")) / "job.yaml"
        f.write_text(out)
        r = subprocess.run(["kubernetes-validate", "--strict", str(f)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr


def _sbatch_script(block: Block) -> None:
    r = subprocess.run(["bash", "-n", str(REPO / "deploy/slurm/elastic.sbatch")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


# Blocks that do not run here, each with why and what runs instead. Keyed by (file, first
# command); keep this list short: a new block belongs here only if it cannot run on one machine.
NOT_HERE = {
    ("README.md", "pip install torch==2.13.0 && pip install -e '.[dev]'"): (
        "installing the project is CI's own first step (re-running it here would reinstall the checkout being tested)",
        lambda b: _ci_runs("python -m pip install --quiet torch==2.13.0", "python -m pip install --quiet -e '.[dev]'"),
    ),
    ("README.md", "python -m pytest"): (
        "the whole test suite, this test included: it is the command CI runs",
        lambda b: _ci_runs("python -m pytest"),
    ),
    ("deploy/README.md", "CKPT_ROOT=s3://bucket/tinygpt sbatch deploy/slurm/elastic.sbatch"): (
        "the script asks Slurm for 2-4 nodes of 16 CPUs; tests/systems/test_slurm.py runs it unchanged under a real "
        "one-node Slurm with --nodes=1 on the sbatch command line",
        _sbatch_script,
    ),
    ("deploy/README.md", "kubectl apply -f deploy/k8s/ckptd.yaml"): (
        "needs a Kubernetes cluster; tests/systems/test_k8s.py validates the manifests and runs their wiring",
        _k8s_manifests_exist,
    ),
    ("deploy/README.md", "kubectl delete job tinygpt-elastic --wait"): (
        "needs a Kubernetes cluster; the sed half of the resize runs here and its output is validated",
        _k8s_resize,
    ),
}


def _key(block: Block) -> tuple[str, str]:
    cmds = block.commands() if block.lang in SHELL else block.text.splitlines()[:1]
    return block.path, (_strip_comment(cmds[0]).strip() if cmds else "")


def _strip_comment(cmd: str) -> str:
    return re.sub(r"\s+#.*$", "", cmd)


def test_every_block_says_what_it_is():
    """A block without a language, or of one nobody runs or lists, fails: nothing is skipped
    by being left unlabelled."""
    bad = [f"{b.id}: {b.lang or '(no language)'}" for b in ALL if b.lang not in SHELL | PYTHON | NOT_RUN]
    assert not bad, "label each block bash, python, or one of " + ", ".join(sorted(NOT_RUN)) + ":\n" + "\n".join(bad)


def test_no_command_is_hidden_as_text():
    words = ("ckptd ", "pip ", "python ", "torchrun ", "kubectl ", "sbatch ", "curl ", "export ", "sudo ", "systemctl ")
    listed = set(SYNOPSES)
    hidden = []
    for b in ALL:
        if b.lang in NOT_RUN and b.lang != "yaml":
            first = next((ln.strip() for ln in b.text.splitlines() if ln.strip()), "")
            command = re.sub(r"^(\w+=\S*\s+)+", "", first)  # VAR=value cmd ...
            if command.startswith(words) and (b.path, _strip_comment(first).strip()) not in listed:
                hidden.append(f"{b.id}: {first}")
    assert not hidden, "a command in a non-run block (label it bash, or list it in SYNOPSES):\n" + "\n".join(hidden)


def test_exceptions_name_existing_blocks():
    keys = {_key(b) for b in RUN}
    stale = [k for k in NOT_HERE if k not in keys]
    texts = {(b.path, _strip_comment(ln).strip()) for b in ALL for ln in b.text.splitlines()[:1]}
    stale += [k for k in SYNOPSES if k not in texts]
    assert not stale, f"listed blocks that no longer exist: {stale}"


def test_setups_name_existing_sections():
    """A runbook setup keyed by a heading that was renamed would silently not run."""
    sections = {(b.path, b.section) for b in RUN}
    stale = [k for k in scenarios.SETUP if k not in sections]
    assert not stale, f"setups for sections that no longer exist: {stale}"


# -- running ------------------------------------------------------------------------------------

_SECTIONS: dict[tuple[str, int], Section] = {}


@pytest.fixture(scope="module")
def sections(s3_server):
    yield _SECTIONS
    for s in list(_SECTIONS.values()):
        s.close()
        shutil.rmtree(s.scratch, ignore_errors=True)
    _SECTIONS.clear()


def _fresh_bucket(endpoint: str) -> None:
    from tests import s3server

    s3 = s3server.client(endpoint)
    try:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket="bucket"):
            for o in page.get("Contents", []):
                s3.delete_object(Bucket="bucket", Key=o["Key"])
        s3.delete_bucket(Bucket="bucket")
    except s3.exceptions.NoSuchBucket:
        pass
    except Exception as e:  # noqa: BLE001 - botocore's ClientError for a missing bucket
        if "NoSuchBucket" not in str(e):
            raise
    s3.create_bucket(Bucket="bucket")


def _section(block: Block, endpoint: str) -> Section:
    key = (block.path, block.section_line)
    if key in _SECTIONS:
        return _SECTIONS[key]
    for other in list(_SECTIONS.values()):  # one section's processes at a time
        other.close()
    # short: the daemon's Unix socket path must stay under 108 bytes
    scratch = Path(tempfile.mkdtemp(prefix="ckptd-doc-"))
    from tests.s3server import CREDENTIALS

    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPTD_", "AWS_"))}
    env.update(CREDENTIALS)
    env.update(
        PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        AWS_ENDPOINT_URL=endpoint,
        CKPTD_PORT=str(docblocks.free_port()),
        CKPTD_SOCKET=str(scratch / "ckptd.sock"),
        CKPTD_STAGING_DIR=str(scratch / "staging"),
        CKPTD_TOKEN_FILE=str(docblocks.new_token_file(scratch)),
        CKPTD_PEER_KEY_FILE=str(docblocks.new_token_file(scratch, "peer-key")),
        ROOT=str(scratch / "job"),
        OMP_NUM_THREADS="1",
    )
    _fresh_bucket(endpoint)
    setup = scenarios.SETUP.get((block.path, block.section))
    if setup is not None:
        setup(env["ROOT"], scratch)
    s = _SECTIONS[key] = Section(key, scratch, env)
    return s


@pytest.mark.timeout(900)
@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_block(block: Block, sections, s3_server):
    exception = NOT_HERE.get(_key(block))
    if exception is not None:
        reason, check = exception
        print(f"not run here: {reason}")  # shown with -rP; what runs instead:
        check(block)
        return
    section = _section(block, s3_server)
    # run alone (-k), a block still gets the earlier blocks of its section first
    for earlier in RUN:
        if earlier is block:
            break
        same = (earlier.path, earlier.section_line) == section.key
        if same and earlier.id not in section.ran and NOT_HERE.get(_key(earlier)) is None:
            section.run(earlier, ALLOWED_FAILURES, timeout=600)
    print(section.run(block, ALLOWED_FAILURES, timeout=600))  # shown with -rP, and on a failure
