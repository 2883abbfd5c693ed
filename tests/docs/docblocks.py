"""The fenced code blocks of the user docs, and a runner that runs them as printed.

``blocks(path)`` parses a markdown file into :class:`Block` s (file, line of the opening fence,
language, the heading it sits under, text without the list indentation). :class:`Section`
runs the blocks of one heading in order, in one scratch folder with one environment, so a
section that starts a daemon, saves through it and reads it back runs as one sequence; what a
block leaves running is stopped when the section ends (by pid, never by name).

What a block may rely on is only what the README's "Running the examples" paragraph names:
ports and scratch paths come from ``CKPTD_PORT``, ``CKPTD_SOCKET``, ``CKPTD_STAGING_DIR``,
``CKPTD_TOKEN_FILE``, ``CKPTD_PEER_KEY_FILE``, ``ROOT`` and ``AWS_ENDPOINT_URL``; the text of a
block is never rewritten.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests import load

REPO = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
HEADING = re.compile(r"^#{1,6}\s+(?P<title>.+?)\s*#*\s*$")

SHELL = {"bash", "sh", "shell"}
PYTHON = {"python", "py"}
# What a block may be instead of something to run: program output, a file layout or a
# command synopsis (text), configuration (yaml, ini, toml, json, systemd units).
NOT_RUN = {"text", "yaml", "ini", "toml", "json", "systemd"}

# A daemon block: every command in it is `ckptd serve ...`. It keeps running, as in the
# terminal a user starts it in, until the end of its section (or the next daemon block).
SERVE = re.compile(r"^ckptd serve\b")


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository
    line: int  # of the opening fence, 1-based
    lang: str
    section: str  # the heading it sits under
    text: str
    section_line: int = 0  # that heading's line: two headings of one title are two sections

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"

    def commands(self) -> list[str]:
        """Shell commands, continuation lines joined, comments and blank lines dropped."""
        out, cur = [], ""
        for raw in self.text.splitlines():
            line = raw.rstrip()
            if not cur and (not line.strip() or line.lstrip().startswith("#")):
                continue
            if line.endswith("\\"):
                cur += line[:-1] + " "
                continue
            out.append((cur + line).strip())
            cur = ""
        return out

    @property
    def is_daemon(self) -> bool:
        cmds = self.commands()
        return self.lang in SHELL and bool(cmds) and all(SERVE.match(c) for c in cmds)


def blocks(path: str) -> list[Block]:
    """Every fenced block of ``path`` (relative to the repository), in order."""
    lines = (REPO / path).read_text().splitlines()
    found: list[Block] = []
    section, section_line = "", 0
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            h = HEADING.match(lines[i])
            if h:
                section, section_line = h["title"], i + 1
            i += 1
            continue
        indent, fence, start = m["indent"], m["fence"], i
        body = []
        i += 1
        while i < len(lines) and not (
            lines[i].strip().startswith(fence[0] * len(fence)) and not lines[i].strip().strip(fence[0])
        ):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        lang = m["info"].strip().split(" ")[0].lower()
        found.append(Block(path, start + 1, lang, section, "\n".join(body) + "\n", section_line))
        i += 1
    return found


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


class BlockFailed(AssertionError):
    pass


class Section:
    """One heading's blocks, run in order in ``scratch`` with ``env``. ``close`` stops what the
    blocks left running (daemons, and any process group they started in the background)."""

    def __init__(self, key: tuple[str, int], scratch: Path, env: dict[str, str]):
        self.key, self.scratch, self.env = key, scratch, env
        self.ran: set[str] = set()
        self.daemons: list[tuple[subprocess.Popen, Path]] = []
        self.background: list[subprocess.Popen] = []

    # -- running ----------------------------------------------------------------------------

    def run(self, block: Block, allowed_failures: dict[str, int], timeout: float) -> str:
        self.ran.add(block.id)
        if block.lang in PYTHON:
            return self._run([sys.executable, self._write(block, ".py")], block, timeout)
        if block.is_daemon:
            return self._start_daemon(block, timeout)
        return self._run(["bash", "--noprofile", "--norc", self._shell(block, allowed_failures)], block, timeout)

    def _write(self, block: Block, suffix: str, prefix: str = "") -> str:
        f = self.scratch / f"block-{Path(block.path).stem}-{block.line}{suffix}"
        f.write_text(prefix + block.text)
        return str(f)

    def _shell(self, block: Block, allowed_failures: dict[str, int]) -> str:
        # -e with a report: the first command that fails ends the block, naming its line. A
        # command the docs say exits nonzero (``ckptd verify`` finding a bad step) is allowed
        # that one status, by its exact text, listed in the test.
        cases = [f"    {_sq(cmd)}:{status}) return 0;;" for cmd, status in allowed_failures.items()]
        head = ["set -o pipefail", "__doc_err() {", '  case "$2:$1" in', *cases, "  esac"]
        head += ['  echo "doc block: line $(($3 - __DOC_OFFSET)) failed with status $1: $2" >&2; exit "$1"', "}"]
        head += ["trap '__doc_err $? \"$BASH_COMMAND\" $LINENO' ERR"]
        head.insert(0, f"__DOC_OFFSET={len(head) + 1}")
        return self._write(block, ".sh", "\n".join(head) + "\n")

    def _run(self, argv: list[str], block: Block, timeout: float) -> str:
        log = self.scratch / f"block-{Path(block.path).stem}-{block.line}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                argv, cwd=REPO, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                raise BlockFailed(f"{block.id} did not finish in {timeout:.0f} s:\n{_tail(log)}") from None
        # whatever the block left in the background (`cmd &`) is stopped with the section
        self.background.append(proc)
        if rc != 0:
            raise BlockFailed(f"{block.id} exited {rc}:\n{_tail(log)}")
        return log.read_text()

    def _start_daemon(self, block: Block, timeout: float) -> str:
        self.stop_daemons()  # one daemon per section at a time: a later example replaces it
        log = self.scratch / f"block-{Path(block.path).stem}-{block.line}.log"
        script = self._write(block, ".sh", "set -e\n")
        with open(log, "w") as out:
            proc = subprocess.Popen(
                ["bash", "--noprofile", "--norc", script],
                cwd=REPO,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.daemons.append((proc, log))
        url = f"http://127.0.0.1:{self.env['CKPTD_PORT']}/healthz"
        deadline = load.deadline(timeout)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise BlockFailed(f"{block.id}: the daemon exited {proc.returncode}:\n{_tail(log)}")
            if answers(url) and Path(self.env["CKPTD_SOCKET"]).exists():
                return log.read_text()
            time.sleep(0.2)
        raise BlockFailed(f"{block.id}: the daemon did not answer {url} in {timeout:.0f} s:\n{_tail(log)}")

    # -- stopping ---------------------------------------------------------------------------

    def stop_daemons(self) -> None:
        while self.daemons:
            proc, log = self.daemons.pop()
            _stop_group(proc)

    def close(self) -> None:
        self.stop_daemons()
        for proc in self.background:
            _kill_group(proc)
        self.background.clear()


def _sq(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


def _tail(log: Path, n: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:])


def _stop_group(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM to the block's process group (the daemon shuts down cleanly), SIGKILL after ``grace``."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)


def new_token_file(folder: Path, name: str = "token") -> Path:
    f = folder / name
    f.write_text(secrets.token_hex(32) + "\n")
    f.chmod(0o600)
    return f
