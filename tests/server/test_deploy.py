"""deploy/ cannot run here (no docker, no cluster, no systemd): lint it. Every file parses, has
the fields its tool requires, and every ``ckptd serve`` flag in it is one the CLI accepts."""

from __future__ import annotations

import configparser
import re
import shlex
from pathlib import Path

import pytest
import yaml

from ckptd.cli.main import build_parser

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _serve_args_ok(args: list[str]) -> None:
    parsed = build_parser().parse_args(["serve", *args])
    assert parsed.command == "serve"


def test_dockerfile_installs_no_torch_and_serves():
    text = (DEPLOY / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    lines = " ".join(ln[:-1] + "\x00" if ln.endswith("\\") else ln + "\n" for ln in lines).replace("\x00 ", "")
    lines = [ln.strip() for ln in lines.splitlines()]  # one instruction per line
    assert lines[0].startswith("FROM python:3.11")
    # the daemon needs no torch (issue 28, item 14): the image installs the server extra only
    assert not any("torch" in ln for ln in lines if ln.startswith("RUN")), lines
    assert any(re.search(r"pip install .*\"\.\[server", ln) for ln in lines)
    for copied in ("ckptd", "trainer_hooks", "storage_backends", "pyproject.toml"):
        assert any(ln.startswith("COPY") and copied in ln for ln in lines), copied
    assert 'ENTRYPOINT ["ckptd", "serve"]' in lines
    assert "EXPOSE 8470" in lines
    cmd = next(ln for ln in lines if ln.startswith("CMD ["))
    _serve_args_ok(yaml.safe_load(cmd[len("CMD ") :]))


def test_compose_runs_ckptd_with_minio():
    doc = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = doc["services"]
    assert {"minio", "ckptd"} <= set(services)
    ck = services["ckptd"]
    assert (DEPLOY / ck["build"]["context"] / ck["build"]["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
    env = ck["environment"]
    assert env["AWS_ENDPOINT_URL"] == "http://minio:9000"
    assert env["AWS_ACCESS_KEY_ID"] == services["minio"]["environment"]["MINIO_ROOT_USER"]
    assert env["AWS_SECRET_ACCESS_KEY"] == services["minio"]["environment"]["MINIO_ROOT_PASSWORD"]
    assert any(v["target"] == "/dev/shm" for v in ck["volumes"])
    assert any(p.startswith("127.0.0.1:") and p.endswith(":8470") for p in ck["ports"])
    args = ck["command"]
    _serve_args_ok(args)
    root = args[args.index("--root") + 1]
    bucket = root.removeprefix("s3://").split("/")[0]
    assert f"local/{bucket}" in " ".join(services["create-bucket"]["command"])
    assert "ckptd_token" in doc["secrets"] and "--token-file" in args  # listens on 0.0.0.0 in the container


@pytest.fixture
def k8s():
    docs = [d for d in yaml.safe_load_all((DEPLOY / "k8s" / "ckptd.yaml").read_text()) if d]
    for d in docs:
        assert {"apiVersion", "kind", "metadata"} <= set(d), d
        assert d["metadata"]["name"]
    return {d["kind"]: d for d in docs}


def test_k8s_daemonset_mounts_host_shm_and_service_stays_on_node(k8s):
    ds, svc, cm = k8s["DaemonSet"], k8s["Service"], k8s["ConfigMap"]
    assert ds["apiVersion"] == "apps/v1"
    spec = ds["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    pod = spec["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] and c["name"]
    _serve_args_ok(c["args"])
    assert "--token-file" in c["args"]
    # the daemons' own credential between nodes: set, from a volume of the daemon's pod
    assert {"name": "CKPTD_PEER_KEY_FILE", "value": "/etc/ckptd-peer/key"} in c["env"]
    port = c["ports"][0]["containerPort"]
    assert port == 8470
    assert c["readinessProbe"]["httpGet"]["path"] == "/healthz"  # the one path without a token
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    shm = next(n for n, v in volumes.items() if "hostPath" in v)
    assert volumes[shm]["hostPath"]["path"].startswith("/dev/shm")
    assert mounts[shm]["mountPath"] == cm["data"]["CKPTD_STAGING_DIR"]
    assert set(mounts) <= set(volumes)
    assert svc["spec"]["selector"].items() <= labels.items()
    assert svc["spec"]["internalTrafficPolicy"] == "Local"
    assert svc["spec"]["ports"][0]["port"] == 8470
    assert yaml.safe_load(cm["data"]["CKPTD_ROOTS"])  # a JSON list, as pydantic-settings reads it
    namespaces = {d["metadata"].get("namespace") for d in (ds, svc, cm)}
    assert namespaces == {k8s["Namespace"]["metadata"]["name"]}


def test_systemd_unit():
    unit = configparser.ConfigParser(interpolation=None, strict=False)
    unit.optionxform = str
    unit.read_string((DEPLOY / "systemd" / "ckptd.service").read_text())
    assert {"Unit", "Service", "Install"} <= set(unit.sections())
    svc = unit["Service"]
    argv = shlex.split(svc["ExecStart"])
    assert argv[0].startswith("/") and argv[0].endswith("/ckptd") and argv[1] == "serve"
    _serve_args_ok(argv[2:])
    assert svc["Restart"] in ("always", "on-failure")
    assert svc["KillSignal"] == "SIGTERM"
    assert "/dev/shm" in svc["ReadWritePaths"]
    assert unit["Install"]["WantedBy"] == "multi-user.target"
