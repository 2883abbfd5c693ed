"""Timeouts and retries for a loaded machine, in one place.

Every fixed bound in the test harness (a subprocess's timeout, a polling deadline, pytest's
``timeout`` mark) is written as its figure on an idle 2-core machine times at least 3, and is
multiplied here by ``SCALE``:

- ``CKPTD_TEST_TIMEOUT_SCALE`` when set (a float >= 1, e.g. ``4`` on a CI machine shared with
  other jobs);
- otherwise the machine's 1-minute load average per core when the test session starts, at least
  1 and at most ``MAX_AUTO_SCALE`` (a machine at load 12 on 2 cores runs everything about 6 times
  slower, and the bounds follow).

``tests/conftest.py`` scales pytest's ``timeout`` marks (and the ini default) the same way and
prints the factor in pytest's header, so a timeout in a report can be read against it.

``retry`` is for the harness's calls to schedulers and servers (Slurm's clients, Ceph's tools,
a server starting up) that fail transiently under load; never for the assertion under test.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

log = logging.getLogger("tests.load")

MAX_AUTO_SCALE = 8.0


def _scale() -> float:
    text = os.environ.get("CKPTD_TEST_TIMEOUT_SCALE", "").strip()
    if text:
        value = float(text)
        if not value >= 1:
            raise ValueError(f"CKPTD_TEST_TIMEOUT_SCALE must be a number >= 1, not {text!r}")
        return value
    try:
        per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return 1.0
    return min(MAX_AUTO_SCALE, max(1.0, round(per_core, 1)))


SCALE = _scale()


def scaled(seconds: float) -> float:
    """``seconds`` (an idle-machine bound, >= 3x the idle time) times ``SCALE``."""
    return seconds * SCALE


def deadline(seconds: float) -> float:
    """``time.monotonic()`` plus ``scaled(seconds)``."""
    return time.monotonic() + scaled(seconds)


def tail(text: str | bytes | None, chars: int = 6000) -> str:
    """The last ``chars`` characters of a child's output, for a failure message."""
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return text[-chars:]


def run(args: Sequence[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(args, capture_output=True, text=True, timeout=scaled(timeout))``; on a
    timeout an AssertionError that carries the tail of what the child wrote so far (a bare
    ``TimeoutExpired`` shows none of it). ``communicate`` reads both pipes to the end, so a child
    writing a lot never blocks on a full pipe."""
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    try:
        return subprocess.run(list(args), timeout=scaled(timeout), **kwargs)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(
            f"{' '.join(map(str, args))} timed out after {e.timeout:.0f} s (idle bound {timeout} s x scale {SCALE})"
            f"\n--- stdout\n{tail(e.stdout)}\n--- stderr\n{tail(e.stderr)}"
        ) from None


def wait(proc: subprocess.Popen, timeout: float, log: str | os.PathLike) -> int:
    """``proc.wait(timeout=scaled(timeout))``; on a timeout an AssertionError with the tail of
    ``log`` (where the child writes); the caller still owns the process (kills it)."""
    try:
        return proc.wait(timeout=scaled(timeout))
    except subprocess.TimeoutExpired:
        try:
            with open(log, errors="replace") as f:
                text = f.read()
        except OSError as e:
            text = f"(no log: {e})"
        raise AssertionError(f"pid {proc.pid} still running after {scaled(timeout):.0f} s\n{tail(text)}") from None


T = TypeVar("T")


def retry(
    call: Callable[[], T],
    transient: Callable[[T | BaseException], bool],
    what: str,
    attempts: int = 5,
    pause: float = 1.0,
) -> T:
    """``call()``, again up to ``attempts`` times in all while ``transient`` says its result (or
    the exception it raised) is a passing error of a loaded scheduler or server, with a WARNING
    line for each retry and a growing pause; the last result is returned (or its exception
    raised) as it is."""
    for n in range(1, attempts + 1):
        try:
            result: T | BaseException = call()
        except Exception as e:  # noqa: BLE001 (judged by ``transient``; re-raised when not)
            result = e
        if n == attempts or not transient(result):
            break
        log.warning("%s: transient failure (attempt %d of %d), retrying: %s", what, n, attempts, _brief(result))
        time.sleep(pause * n)
    if isinstance(result, BaseException):
        raise result
    return result


def _brief(result: object) -> str:
    if isinstance(result, subprocess.CompletedProcess):
        return f"exit {result.returncode}: {tail(result.stderr, 300).strip()}"
    return tail(repr(result), 300)
