"""Tests run daemons as the docs print them (token on, the daemon's own Unix socket, the peer key
for rings): the harness (``tests/server/daemon.py``) defaults to that, and a test or benchmark
that turns on ``--trust-tcp`` or ``--insecure-no-auth`` (the flags, or ``trust_tcp=True`` /
``insecure_no_auth=True``) must be on ``ALLOWED`` with its reason: a test that needs either mode
to pass proves nothing about what users run."""

from __future__ import annotations

import inspect
import io
import tokenize
from pathlib import Path

from tests.server import daemon as harness

ROOT = Path(__file__).resolve().parents[2]
FLAGS = {"--trust-tcp", "--insecure-no-auth"}
KEYWORDS = {"trust_tcp", "insecure_no_auth"}

# path: (uses, why). ``uses``: how many times the file turns either mode on, so a new use in an
# allowed file is caught too.
ALLOWED: dict[str, tuple[int, str]] = {
    "tests/server/daemon.py": (2, "the harness: passes the flags when a listed test asks for them"),
    "tests/security/test_daemon_staging.py": (
        2,
        "tests --insecure-no-auth itself: the refusal to start without a token names it; its WARNING",
    ),
    "tests/security/test_status_page_csrf_browser.py": (1, "a cross-site form: the attack on a page with no token"),
    "tests/security/test_status_page_hostile.py": (1, "cross-site POSTs: the attack on a page with no token"),
    "tests/security/test_tier_trust.py": (
        1,
        "the issue's push into another tenant's root worked with --trust-tcp too: rerun against a ring of that mode",
    ),
    "tests/server/test_deploy.py": (1, "asserts that the shipped systemd unit does not pass --trust-tcp"),
    "tests/systems/test_k8s.py": (
        1,
        "runs the shipped DaemonSet's args, which print --trust-tcp (pods reach the node's daemon on hostPort)",
    ),
}


def _uses(text: str) -> int:
    """The times ``text`` turns on a mode: a string literal that is exactly one of the flags, or
    ``trust_tcp``/``insecure_no_auth`` assigned or passed ``True``."""
    n = 0
    toks = [t for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type != tokenize.NL]
    for i, t in enumerate(toks):
        if t.type == tokenize.STRING and t.string.strip("\"'") in FLAGS:
            n += 1
        if t.type == tokenize.NAME and t.string in KEYWORDS:
            rest = [x.string for x in toks[i + 1 : i + 8]]  # ``=True``, ``: bool = True``, ``=x or True``
            value = rest[rest.index("=") + 1] if "=" in rest[:4] and rest.index("=") + 1 < len(rest) else None
            n += value == "True"
    return n


def _files() -> list[Path]:
    return sorted(p for d in ("tests", "benchmarks") for p in (ROOT / d).rglob("*.py"))


def test_the_harness_defaults_to_the_documented_configuration():
    for fn in (harness.Daemon.__init__, harness.node):
        params = inspect.signature(fn).parameters
        assert params["trust_tcp"].default is False, fn
        assert "insecure_no_auth" not in params or params["insecure_no_auth"].default is False, fn


def test_only_listed_files_turn_on_trust_tcp_or_insecure_no_auth():
    found = {}
    for path in _files():
        rel = path.relative_to(ROOT).as_posix()
        if rel == "tests/unit/test_documented_config.py":
            continue
        n = _uses(path.read_text())
        if n:
            found[rel] = n
    unlisted = {p: n for p, n in found.items() if p not in ALLOWED}
    assert not unlisted, f"run these daemons as the docs print them, or list them with a reason: {unlisted}"
    more = {p: (n, ALLOWED[p][0]) for p, n in found.items() if n > ALLOWED[p][0]}
    assert not more, f"more uses than listed (found, listed): {more}"
    stale = sorted(set(ALLOWED) - set(found))
    assert not stale, f"listed but no longer needed: {stale}"


def test_the_scan_sees_each_spelling():
    code = 'a = ["serve", "--trust-tcp"]\nf(x, trust_tcp=True)\nd.insecure_no_auth = True\nb = "--insecure-no-auth"\n'
    code += "def g(trust_tcp: bool = True): pass\n"
    assert _uses(code) == 5
    assert _uses('"""mentions --trust-tcp in prose"""\nf(trust_tcp=False)\n# trust_tcp=True\n') == 0
