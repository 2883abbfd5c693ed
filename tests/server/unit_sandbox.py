"""Run ``deploy/systemd/ckptd.service`` as systemd would, as far as one container allows.

No systemd runs here, so the unit's sandbox is built by hand in a private mount namespace
(``unshare -m``), from the settings parsed out of the shipped unit and its
``deploy/systemd/ckptd.env``:

* the node's own ``/dev/shm``, ``/run`` and ``/var/lib`` (tmpfs: another machine's), ``/etc``
  an overlay holding the unit's user and group, ``/etc/ckptd/{ckptd.env,token,peer-key}``;
* ``/opt/ckptd/bin/ckptd`` (the unit's ExecStart) runs this checkout with this Python;
* ``StateDirectory=`` and ``RuntimeDirectory=`` created with their modes, owned by ``User=``;
* ``ProtectSystem=strict``: every mount read-only except ``/proc``, ``/sys`` and ``/dev``; then
  each ``ReadWritePaths=`` path, the state and
  the runtime directory bound writable again (as systemd does); ``PrivateTmp=``: a new ``/tmp``;
  ``ProtectHome=``: ``/home`` and ``/root`` empty and read-only, except that this machine's
  Python lives under ``/root/.pyenv`` and is bound back, read-only (on a node it is /opt/ckptd);
* ``User=``, ``Group=``, ``AmbientCapabilities=``, ``CapabilityBoundingSet=``,
  ``NoNewPrivileges=`` through ``setpriv``; ``UMask=``, ``LimitNOFILE=``; the environment of
  ``Environment=`` lines overridden by the env file (systemd's order), then by the test.

Not emulated: ``MemoryMax=`` (no writable cgroup tree here), ``Restart=``; ``LimitNOFILE=``
above this container's hard limit (no ``CAP_SYS_RESOURCE``) is cut to it. A process started
with ``enter(pid)`` runs in the same namespace (a trainer on that node).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "deploy" / "systemd" / "ckptd.service"
ENV_FILE = REPO / "deploy" / "systemd" / "ckptd.env"
CODE = "/opt/ckptd/src"  # REPO inside the sandbox (PrivateTmp and ProtectHome hide it where it is)
UID = 1990  # the unit's User= and Group= inside the namespace (unused on this machine)

SCRIPT = r"""
set -euo pipefail
S=$SB_SCRATCH
mount -t tmpfs -o mode=0700 tmpfs "$S"
mkdir "$S/up" "$S/work"
cp "$SB_IN/token" "$SB_IN/peer-key" "$SB_IN/ckptd.env" "$S/"
mount -t overlay overlay -o "lowerdir=/etc,upperdir=$S/up,workdir=$S/work" /etc
echo "$SB_USER:x:$SB_UID:$SB_UID::/nonexistent:/usr/sbin/nologin" >>/etc/passwd
echo "$SB_GROUP:x:$SB_UID:" >>/etc/group
install -d -m 0755 /etc/ckptd
install -m 0640 -g "$SB_GROUP" "$S/token" /etc/ckptd/token
install -m 0600 -o "$SB_USER" -g "$SB_GROUP" "$S/peer-key" /etc/ckptd/peer-key
install -m 0644 "$S/ckptd.env" /etc/ckptd/ckptd.env
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t tmpfs -o mode=0755 tmpfs /run
mount -t tmpfs -o mode=0755 tmpfs /var/lib
mount -t tmpfs -o mode=0755 tmpfs /opt
install -d -m 0755 /opt/ckptd/bin /opt/ckptd/src
mount --bind "$SB_REPO" /opt/ckptd/src  # the code, where a node installs it: the checkout may sit in /tmp or a home
printf '#!/bin/sh\nexec %s -m ckptd.cli.main "$@"\n' "$SB_PYTHON" >/opt/ckptd/bin/ckptd
chmod 0755 /opt/ckptd/bin/ckptd
RW=$SB_RW
if [ -n "$SB_STATE" ]; then  # StateDirectory=, RuntimeDirectory=: systemd makes them writable
    install -d -m "$SB_STATE_MODE" -o "$SB_USER" -g "$SB_GROUP" "/var/lib/$SB_STATE"
    RW="$RW /var/lib/$SB_STATE"
fi
if [ -n "$SB_RUNTIME" ]; then
    install -d -m "$SB_RUNTIME_MODE" -o "$SB_USER" -g "$SB_GROUP" "/run/$SB_RUNTIME"
    RW="$RW /run/$SB_RUNTIME"
fi
if [ -n "$SB_PY_HOME" ]; then mkdir "$S/py" && mount --bind "$SB_PY_HOME" "$S/py"; fi
eval "$SB_PREP"
# ProtectSystem=strict
while read -r _ target _; do
    case $target in /proc | /proc/* | /sys | /sys/* | /dev | /dev/* | /mnt/*) continue ;; esac
    mount -o remount,bind,ro "$target"
done </proc/self/mounts
for p in $RW; do
    case $p in /dev | /dev/*) continue ;; esac  # not made read-only above
    mount --bind "$p" "$p"
    mount -o remount,bind,rw "$p"
done
mount -t tmpfs -o ro tmpfs /home                                   # ProtectHome
mount -t tmpfs -o mode=0755 tmpfs /root
if [ -n "$SB_PY_HOME" ]; then  # this machine's Python, bound back read-only
    mkdir -p "$SB_PY_HOME"
    mount --bind "$S/py" "$SB_PY_HOME"
    mount -o remount,bind,ro "$SB_PY_HOME"
fi
mount -o remount,ro /root
mapfile -d '' ENV <"$SB_IN/env"
mount -t tmpfs tmpfs /tmp                                          # PrivateTmp
ulimit -n "$SB_NOFILE" 2>/dev/null || ulimit -n "$(ulimit -Hn)"  # no CAP_SYS_RESOURCE here
umask "$SB_UMASK"
cd /
if [ -n "$SB_RUN_AS" ]; then  # another user, without the unit's capabilities
    exec setpriv --reuid "$SB_RUN_AS" --regid "$SB_RUN_AS" --init-groups \
        --inh-caps=-all --ambient-caps=-all --bounding-set=-all --no-new-privs env -i "${ENV[@]}" "$@"
fi
exec setpriv --reuid "$SB_USER" --regid "$SB_GROUP" --init-groups \
    --inh-caps="$SB_CAPS" --ambient-caps="$SB_CAPS" --bounding-set="-all,$SB_CAPS" $SB_NNP \
    env -i "${ENV[@]}" "$@"
"""


def unit() -> dict[str, list[str]]:
    """``[Service]`` key -> its values, in order (keys may repeat)."""
    out: dict[str, list[str]] = {}
    section = None
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key}", []).append(value)
    return out


def _assignments(text: str) -> dict[str, str]:
    return dict(word.split("=", 1) for word in shlex.split(text))


def environment(overrides: dict[str, str] | None = None) -> dict[str, str]:
    """The daemon's environment: the unit's ``Environment=`` lines, then its env file
    (``deploy/systemd/ckptd.env``, which systemd lets win), then ``overrides``."""
    env: dict[str, str] = {}
    for line in unit()["Service.Environment"]:
        env |= _assignments(line)
    env |= env_file()
    return env | (overrides or {})


def env_file() -> dict[str, str]:
    out: dict[str, str] = {}
    for line in ENV_FILE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            out |= _assignments(line)
    return out


def _caps(names: list[str]) -> str:
    caps = " ".join(names).split()
    return ",".join("+" + c.lower().removeprefix("cap_") for c in caps)


def start(
    scratch: Path,
    overrides: dict[str, str],
    token: str,
    peer_key: str,
    log: Path,
    prep: str = "",
    run_as: str = "",
) -> subprocess.Popen:
    """The unit's ExecStart under its sandbox; stdout and stderr to ``log``. ``prep``: shell run
    inside the namespace before the file system is made read-only. ``run_as``: a user of this
    machine to run the daemon as instead of ``User=``, without the unit's capabilities."""
    u = unit()
    inputs = scratch / "in"
    inputs.mkdir(parents=True)
    (inputs / "token").write_text(token)
    (inputs / "peer-key").write_text(peer_key)
    (inputs / "ckptd.env").write_text(ENV_FILE.read_text())
    env = environment({"PYTHONPATH": CODE, "PATH": "/usr/bin:/bin"} | overrides)
    (inputs / "env").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))
    (scratch / "ns").mkdir()
    py_home = sys.base_prefix if sys.base_prefix.startswith(("/root/", "/home/")) else ""
    sb = {
        "SB_SCRATCH": str(scratch / "ns"),
        "SB_REPO": str(REPO),
        "SB_IN": str(inputs),
        "SB_USER": u["Service.User"][-1],
        "SB_GROUP": u["Service.Group"][-1],
        "SB_UID": str(UID),
        "SB_PYTHON": str(Path(sys.base_prefix) / "bin" / "python3"),
        "SB_PY_HOME": py_home,
        "SB_STATE": u.get("Service.StateDirectory", [""])[-1],
        "SB_STATE_MODE": u.get("Service.StateDirectoryMode", ["0755"])[-1],
        "SB_RUNTIME": u.get("Service.RuntimeDirectory", [""])[-1],
        "SB_RUNTIME_MODE": u.get("Service.RuntimeDirectoryMode", ["0755"])[-1],
        "SB_RW": " ".join(" ".join(u["Service.ReadWritePaths"]).split()),
        "SB_CAPS": _caps(u["Service.AmbientCapabilities"]),
        "SB_NNP": "--no-new-privs" if u.get("Service.NoNewPrivileges") == ["true"] else "",
        "SB_NOFILE": u["Service.LimitNOFILE"][-1],
        "SB_UMASK": u["Service.UMask"][-1],
        "SB_PREP": prep,
        "SB_RUN_AS": run_as,
    }
    assert _caps(u["Service.CapabilityBoundingSet"]) == sb["SB_CAPS"]
    assert u["Service.ProtectSystem"] == ["strict"] and u["Service.PrivateTmp"] == ["true"]
    argv = shlex.split(u["Service.ExecStart"][-1])
    with open(log, "wb") as out:
        return subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "bash", "-c", SCRIPT, "sandbox", *argv],
            env={**os.environ, **sb},
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def enter(pid: int, argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """Run ``argv`` as root in the mount namespace of ``pid`` (another process on that node)."""
    return subprocess.run(
        ["nsenter", "-t", str(pid), "-m", "--", "env", "-i", *(f"{k}={v}" for k, v in env.items()), *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
