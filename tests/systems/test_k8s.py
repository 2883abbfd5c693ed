"""The Kubernetes recipes: every manifest against the Kubernetes schemas (kubernetes-validate,
offline, strict), and the trainer-to-daemon wiring that ``deploy/k8s/elastic-job.yaml`` describes
run for real on this machine.

No cluster runs here. Two pods on one node share exactly what the manifests give them: the
hostPath staging folder (at the daemon's path), the node's IP and the DaemonSet's hostPort, the
token Secret. The wiring test reads those from the manifests and starts the daemon and the
trainers as separate processes that share only a folder and a loopback port, then SIGKILLs the
trainers right after a save was handed off: the daemon must commit it, and a job resumed at
another size through the same wiring must finish bitwise equal to an uninterrupted run, with
every sample of the epoch trained on once.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml

from tests import load
from tests.distributed import launch
from tests.server.daemon import Daemon

kubernetes_validate = pytest.importorskip("kubernetes_validate")

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
K8S_VERSION = "1.37.0"  # the newest schemas bundled with kubernetes-validate 1.37
SAMPLES, GLOBAL_BATCH = 240, 12

# Above the sum of the wiring test's own bounds below (~1,400 s), so that one of those fires
# first, with its output; idle the file takes ~1-2 min. Both times ``load.SCALE``.
pytestmark = pytest.mark.timeout(1500)


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def _kind(name: str, kind: str) -> dict:
    (doc,) = [d for d in _docs(name) if d["kind"] == kind]
    return doc


@pytest.mark.parametrize("name", sorted(p.name for p in K8S.glob("*.yaml")))
def test_manifest_validates_against_the_kubernetes_schemas(name):
    for doc in _docs(name):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_validator_rejects_a_misspelt_field():
    """The check above is worth something only if strict validation refuses unknown fields."""
    job = copy.deepcopy(_kind("elastic-job.yaml", "Job"))
    job["spec"]["template"]["spec"]["volumes"][1]["hostPath"]["typ"] = "Directory"
    with pytest.raises(kubernetes_validate.ValidationError, match="typ"):
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)


def _container(job: dict) -> dict:
    (c,) = job["spec"]["template"]["spec"]["containers"]
    return c


def _env(container: dict, host_ip: str) -> dict[str, str]:
    """The container's environment as the kubelet builds it: the downward API's status.hostIP,
    ``$(VAR)`` references to earlier variables expanded."""
    env: dict[str, str] = {}
    for e in container["env"]:
        if "valueFrom" in e:
            assert e["valueFrom"] == {"fieldRef": {"fieldPath": "status.hostIP"}}, e
            env[e["name"]] = host_ip
        else:
            value = e["value"]
            for k, v in env.items():
                value = value.replace(f"$({k})", v)
            env[e["name"]] = value
    return env


def _mounts(pod: dict, container: dict) -> dict[str, dict]:
    """mountPath -> the volume mounted there."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    return {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}


def test_daemon_variant_is_the_inprocess_job_plus_the_handoff():
    """The two Job variants must not drift apart: removing the hand-off from elastic-job.yaml
    gives elastic-job-inprocess.yaml."""
    with_daemon, inprocess = _kind("elastic-job.yaml", "Job"), _kind("elastic-job-inprocess.yaml", "Job")
    stripped = copy.deepcopy(with_daemon)
    pod = stripped["spec"]["template"]["spec"]
    del pod["securityContext"]
    pod["volumes"] = [v for v in pod["volumes"] if v["name"] not in ("ckptd-staging", "ckptd-token")]
    c = _container(stripped)
    c["volumeMounts"] = [m for m in c["volumeMounts"] if m["name"] not in ("ckptd-staging", "ckptd-token")]
    c["env"] = [e for e in c["env"] if e["name"] not in ("HOST_IP", "CKPTD_DAEMON", "CKPTD_TOKEN_FILE")]
    for e in c["env"]:
        if e["name"] == "CKPT_ROOT":
            e["value"] = next(x["value"] for x in _container(inprocess)["env"] if x["name"] == "CKPT_ROOT")
    c["args"] = [a.replace(' --daemon "$CKPTD_DAEMON" \\\n  ', " ") for a in c["args"]]
    assert stripped == inprocess
    assert _docs("elastic-job.yaml")[0] == _docs("elastic-job-inprocess.yaml")[0]  # the Service


def test_daemon_wiring_is_consistent_with_the_daemonset():
    daemonset, config = _kind("ckptd.yaml", "DaemonSet"), _kind("ckptd.yaml", "ConfigMap")["data"]
    job = _kind("elastic-job.yaml", "Job")
    dpod, jpod = daemonset["spec"]["template"]["spec"], job["spec"]["template"]["spec"]
    (dc,), jc = dpod["containers"], _container(job)
    env = _env(jc, "10.0.0.7")
    # the address: the node's IP and the DaemonSet's hostPort, which is the port it serves on
    port, data = dc["ports"]  # the API's, and the tier data path's (peers read the memory tier there)
    assert port["hostPort"] == port["containerPort"] == int(dc["args"][dc["args"].index("--port") + 1])
    assert data["hostPort"] == data["containerPort"] == int(config["CKPTD_TIER_DATA_PORT"])
    assert env["CKPTD_DAEMON"] == f"http://10.0.0.7:{port['hostPort']}"
    assert '--daemon "$CKPTD_DAEMON"' in jc["args"][0]
    # the staging folder: the same host folder at the same path on both sides, the daemon's own
    staging = config["CKPTD_STAGING_DIR"]
    dvol, jvol = _mounts(dpod, dc)[staging], _mounts(jpod, jc)[staging]
    assert dvol["hostPath"]["path"] == jvol["hostPath"]["path"] == staging
    assert dvol["hostPath"]["type"] == "DirectoryOrCreate" and jvol["hostPath"]["type"] == "Directory"
    # the same uid/gid (staged files are not world-readable)
    for key in ("runAsUser", "runAsGroup"):
        assert jpod["securityContext"][key] == dpod["securityContext"][key]
    # the token: the same Secret key, at the path CKPTD_TOKEN_FILE names and --token-file reads
    token_dir = str(Path(env["CKPTD_TOKEN_FILE"]).parent)
    dtok, jtok = _mounts(dpod, dc)[token_dir], _mounts(jpod, jc)[token_dir]
    assert dtok["secret"] == jtok["secret"]
    assert dc["args"][dc["args"].index("--token-file") + 1] == env["CKPTD_TOKEN_FILE"]
    # the job root is one the daemon serves
    assert any(env["CKPT_ROOT"].startswith(r.rstrip("/") + "/") for r in json.loads(config["CKPTD_ROOTS"]))


def _steps(log_dir: Path) -> list[dict]:
    out = []
    for f in sorted(log_dir.glob("rank*.jsonl")):
        out += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return out


def _committed(root: Path) -> list[int]:
    p = load.run(  # idle ~2 s
        [sys.executable, "-m", "ckptd.cli.main", "ls", str(root), "--json"],
        120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    if p.returncode != 0:
        return []
    return [r["step"] for r in json.loads(p.stdout) if r["committed"]]


def _wait_gone(pid: int, timeout: float = 60.0) -> None:
    deadline = load.deadline(timeout)
    while Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < deadline, f"process {pid} survived SIGKILL"
        time.sleep(0.05)


def _torchrun(nproc: int, args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    with open(log, "ab") as out:
        return subprocess.Popen(
            cmd + ["tests/systems/exact_train.py", *args],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: SIGKILL reaches torchrun and every rank
        )


@pytest.mark.slow
def test_trainers_hand_off_to_a_separate_daemon_through_the_manifest_wiring(tmp_path):
    job = _kind("elastic-job.yaml", "Job")
    pod, container = job["spec"]["template"]["spec"], _container(job)
    daemonset_config = _kind("ckptd.yaml", "ConfigMap")["data"]
    manifest_env = _env(container, "127.0.0.1")  # this machine is the node; loopback its IP
    staging_in_manifest = daemonset_config["CKPTD_STAGING_DIR"]

    # The node's folders: the hostPath staging folder, the token Secret, the storage.
    staging = tmp_path / "host-dev-shm-ckptd"  # stands for the hostPath; both "pods" see it
    staging.mkdir()
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "token").write_text("s3cret-token-for-the-node\n")
    storage = tmp_path / "storage"
    root = storage / "tinygpt"
    paths = {staging_in_manifest: str(staging), str(Path(manifest_env["CKPTD_TOKEN_FILE"]).parent): str(secret)}
    assert set(paths) <= set(_mounts(pod, container)), "the trainer pod mounts both"

    # The reference: one process, in-process saves, never stopped.
    base = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "EXACT_SAMPLES": str(SAMPLES)}
    for k in ("CKPTD_DAEMON", "CKPTD_TOKEN", "CKPTD_TOKEN_FILE"):
        base.pop(k, None)
    ref = load.run(  # idle ~20 s
        [sys.executable, "tests/systems/exact_train.py", "--root", str(tmp_path / "ref")]
        + ["--global-batch", str(GLOBAL_BATCH), "--final", str(tmp_path / "ref.pt")],
        300,
        cwd=REPO,
        env=base,
    )
    assert ref.returncode == 0, ref.stderr

    # The daemon "pod": its staging folder and token file, a port; uploads slowed down so that
    # the trainers die before the commit.
    port = launch.free_port()
    daemon = Daemon(
        [str(storage)],
        staging,
        tmp_path / "daemon.log",
        token_file=secret / "token",
        # the DaemonSet's own args: the manifest prints --trust-tcp (pods reach it on hostPort)
        trust_tcp="--trust-tcp" in _container(_kind("ckptd.yaml", "DaemonSet"))["args"],
        upload_delay_s=3,
    )
    # The trainer "pod": the manifest's environment, its paths mapped to this machine's folders.
    trainer_env = {**base}
    for k in ("CKPTD_DAEMON", "CKPTD_TOKEN_FILE"):
        value = manifest_env[k]
        for inside, outside in paths.items():
            value = value.replace(inside, outside)
        trainer_env[k] = value
    trainer_env["CKPTD_DAEMON"] = trainer_env["CKPTD_DAEMON"].replace(":8470", f":{port}")
    logs, hold = tmp_path / "logs", tmp_path / "hold"
    trainer_env.update(EXACT_LOG_DIR=str(logs), EXACT_HOLD_FILE=str(hold), EXACT_FINAL=str(tmp_path / "final.pt"))
    args = ["--root", str(root), "--daemon", trainer_env["CKPTD_DAEMON"], "--global-batch", str(GLOBAL_BATCH)]
    args += ["--every", "5"]

    trainers = None
    daemon.start(port=port)
    try:
        # 2 ranks: step 4 is saved (handed off), then the ranks hold after step 5; SIGKILL them.
        hold.write_text("5")
        trainers = _torchrun(2, args, trainer_env, tmp_path / "trainers-2.log")
        deadline = load.deadline(300)  # idle ~20 s
        while len({r["rank"] for r in _steps(logs) if r["event"] == "step" and r["step"] == 5}) < 2:
            assert trainers.poll() is None, (tmp_path / "trainers-2.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "the trainers did not reach step 5\n" + load.tail(
                (tmp_path / "trainers-2.log").read_text()
            )
            time.sleep(0.1)
        # torchrun starts its ranks in sessions of their own: kill them by the pids they logged
        ranks = [r["pid"] for r in _steps(logs) if r["event"] == "start" and r["world"] == 2]
        os.killpg(trainers.pid, signal.SIGKILL)
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        trainers.wait(timeout=load.scaled(60))
        for pid in ranks:
            _wait_gone(pid)
        assert 4 not in _committed(root), "step 4 was committed before the trainers died: nothing tested"

        # The daemon commits what it was handed, with every trainer dead.
        deadline = load.deadline(180)  # idle ~10 s (the uploads slowed by 3 s)
        while 4 not in _committed(root):
            assert time.monotonic() < deadline, daemon.logs()
            time.sleep(0.5)

        # Resume at 3 ranks through the same wiring (daemon restarted without the slowdown).
        daemon.stop()
        daemon.upload_delay_s = 0
        daemon.start(port=port)
        hold.unlink()
        trainers = _torchrun(3, args, trainer_env, tmp_path / "trainers-3.log")
        assert load.wait(trainers, 300, tmp_path / "trainers-3.log") == 0, (  # idle ~30 s
            tmp_path / "trainers-3.log"
        ).read_text()[-4000:]
    finally:
        if trainers is not None and trainers.poll() is None:
            os.killpg(trainers.pid, signal.SIGKILL)
        daemon.stop()

    # The history that counts: each step's last run (step 5 ran at 2 ranks, then died uncommitted).
    records = [r for r in _steps(logs) if r["event"] == "step"]
    last_world = {}
    for r in records:
        last_world[r["step"]] = r["world"]
    final_steps = [r for r in records if r["world"] == last_world[r["step"]] and (r["world"] == 3 or r["step"] <= 4)]
    assert sorted({r["step"] for r in final_steps}) == list(range(SAMPLES // GLOBAL_BATCH))
    assert {r["step"] for r in records if r["world"] == 3} == set(range(5, SAMPLES // GLOBAL_BATCH))
    seen = Counter(i for r in final_steps for i in r["indices"])
    assert sorted(seen) == list(range(SAMPLES)) and set(seen.values()) == {1}
    final, reference = torch.load(tmp_path / "final.pt"), torch.load(tmp_path / "ref.pt")
    assert final.keys() == reference.keys()
    for k in reference:
        assert torch.equal(final[k], reference[k]), k
