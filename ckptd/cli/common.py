"""What every subcommand shares: opening the job root, output (table or ``--json``), errors and
a progress bar.

Output contract: results go to stdout (a table for humans, one JSON document with ``--json``);
errors, notes and progress go to stderr, so ``ckptd ls --json URI | jq`` always sees clean JSON.

Names, keys, reasons and messages come from storage that someone else may write: every string
printed for humans goes through ``printable`` (``print_table``, ``note`` and ``error`` apply it),
so a planted newline cannot forge a line and a planted escape sequence never reaches the
terminal. ``--json`` output is JSON-escaped already.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, TextIO

from ckptd.units import human_bytes
from storage_backends import StorageError, Store, open_store

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_USAGE",
    "PREFIX",
    "Progress",
    "UsageError",
    "add_json",
    "add_step",
    "add_uri",
    "error",
    "human_bytes",
    "iso_time",
    "job_root",
    "note",
    "positive_int",
    "print_json",
    "print_table",
    "printable",
    "shape_str",
    "step_arg",
]

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

PREFIX = "ckptd: "


class UsageError(Exception):
    """Bad usage the parser could not catch (an unknown URI scheme, a malformed URI): exit 2."""


@contextmanager
def job_root(uri: str) -> Iterator[Store]:
    """The store of a job root URI, closed on exit. Everything ``open_store`` rejects is about
    the URI or its configuration, never about data: bad usage (exit 2), not a failed operation."""
    try:
        store = open_store(uri)
    except (StorageError, ValueError) as e:
        raise UsageError(str(e)) from None
    with store:
        yield store


def _int_at_least(text: str, what: str, least: int, rule: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid {what} {text!r}: expected an integer") from None
    if n < least:
        raise argparse.ArgumentTypeError(f"invalid {what} {n}: {rule}")
    return n


def step_arg(text: str) -> int:
    return _int_at_least(text, "step", 0, "steps are >= 0")


def positive_int(text: str) -> int:
    return _int_at_least(text, "count", 1, "must be >= 1")


def add_uri(p: argparse.ArgumentParser) -> None:
    p.add_argument("uri", metavar="URI", help="job root: /path, file:///path, s3://bucket/prefix, memory://name")


def add_step(p: argparse.ArgumentParser) -> None:
    p.add_argument("--step", type=step_arg, default=None, help="step to use (default: latest committed)")


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print machine-readable JSON on stdout")


# C0 and C1 controls (newline, carriage return, ESC, ...), DEL, and the Unicode line separators
# and bidirectional overrides that reorder or break what a terminal shows.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: Any) -> str:
    """``str(text)`` with every control character written as a Python escape (``\\n``,
    ``\\x1b``, ``\\u202e``): safe to print on one line of a terminal or a log."""
    return _UNPRINTABLE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), str(text))


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, allow_nan=False)
    sys.stdout.write("\n")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Left-aligned columns, two spaces apart, on stdout; numeric-looking cells right-aligned."""
    cells = [[printable(h) for h in headers], *[[printable(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    right = [all(isinstance(r[i], int | float) for r in rows) and bool(rows) for i in range(len(headers))]
    for r in cells:
        parts = [c.rjust(w) if ra else c.ljust(w) for c, w, ra in zip(r, widths, right, strict=True)]
        sys.stdout.write("  ".join(parts).rstrip() + "\n")


def error(message: str) -> None:
    """One line on stderr, prefixed ``ckptd: error:``; newlines in the message are flattened so
    one error is always one line."""
    line = printable(" ".join(str(message).split())) or "unknown error"
    sys.stderr.write(f"{PREFIX}error: {line}\n")
    sys.stderr.flush()


def note(message: str) -> None:
    sys.stderr.write(f"{PREFIX}{printable(message)}\n")


def iso_time(t: float | None) -> str:
    """ISO 8601 in UTC, to the second (``2025-01-31T12:00:00Z``)."""
    if t is None:
        return "-"
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def shape_str(shape: Sequence[int]) -> str:
    return "(" + ", ".join(str(n) for n in shape) + ("," if len(shape) == 1 else "") + ")"


class Progress:
    """A one-line progress bar on stderr, drawn only when stderr is a terminal (never into logs
    or pipes) and at most ten times a second. Use as ``progress(done, total)``; ``close()``
    clears the line."""

    WIDTH = 30

    def __init__(self, label: str, stream: TextIO | None = None):
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = False
        with contextlib.suppress(AttributeError, ValueError):  # a stream without a working isatty
            self.enabled = self.stream.isatty()
        self._last = 0.0
        self._drawn = False

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if not self.enabled or (done < total and now - self._last < 0.1):
            return
        self._last = now
        frac = done / total if total else 1.0
        bar = "#" * int(frac * self.WIDTH)
        self.stream.write(f"\r{self.label} [{bar:<{self.WIDTH}}] {frac:4.0%} {done}/{total}")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._drawn = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
