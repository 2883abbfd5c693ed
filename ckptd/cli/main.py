"""``ckptd``: entry point of the command line.

Each subcommand is a module of this package with three names:

* ``HELP``: its one-line help;
* ``add_arguments(parser)``: declares its arguments on its subparser;
* ``run(args) -> int``: does the work and returns the exit status.

Adding a subcommand is one word in ``_NAMES``. Modules are imported when the parser is built,
so a command with heavy dependencies (``serve``: FastAPI) imports them inside ``run``.

Exit status: 0 success, 1 a failed check or operation, 2 bad usage, 130 interrupted. Every
error is one line on stderr starting ``ckptd: error:``; no traceback reaches the user.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ckptd import FORMAT_VERSION, __version__
from ckptd.cli.common import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, UsageError, error
from ckptd.errors import CheckpointError
from storage_backends import StorageError

__all__ = ["COMMANDS", "build_parser", "main"]

# an optional dependency a command may need -> the extra that installs it
_EXTRAS = {"torch": "torch", "safetensors": "interop", "fastapi": "server", "uvicorn": "server", "obstore": "s3"}

UNEXPECTED = (RecursionError, TypeError, AttributeError, OverflowError, KeyError, IndexError, ZeroDivisionError)

# subcommand -> module under ckptd.cli (a module cannot be named ``import``: use ``import_``).
_NAMES = "ls show verify gc fence quarantine unquarantine serve reshard export import diff"
COMMANDS: dict[str, str] = {name: "import_" if name == "import" else name for name in _NAMES.split()}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckptd", description="Inspect, check and manage ckptd checkpoints (Zarr v3 on object storage)."
    )
    parser.add_argument("--version", action="version", version=f"ckptd {__version__} (format version {FORMAT_VERSION})")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in COMMANDS.items():
        mod = importlib.import_module(f"ckptd.cli.{module}")
        p = sub.add_parser(name, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``ckptd`` with ``argv`` (``sys.argv[1:]`` when None); returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version (0) and bad arguments (2): argparse has printed
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_usage(sys.stderr)
        error("no command given (see ckptd --help)")
        return EXIT_USAGE
    try:
        rc = args._run(args)
        sys.stdout.flush()  # a closed pipe must surface here, not as a message at exit
        return rc
    except UsageError as e:
        error(str(e))
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader of stdout went away (``ckptd ls | head``): stop quietly, and keep Python from
        # complaining about the unflushed stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
    except ModuleNotFoundError as e:
        # A command whose optional dependency is not installed (export/import need torch).
        top = (e.name or "").split(".")[0]
        extra = _EXTRAS.get(top)
        if extra is None:
            raise
        error(f"ckptd {args.command} needs {top}, which is not installed: pip install 'ckptd[{extra}]'")
        return EXIT_FAILED
    except (CheckpointError, StorageError, OSError, ValueError) as e:
        error(str(e) or type(e).__name__)
        return EXIT_FAILED
    except MemoryError:
        error("out of memory (a checkpoint declaring absurd sizes?)")
        return EXIT_FAILED
    except UNEXPECTED as e:
        # Hostile input that no check foresaw (deep JSON, wrong types, huge numbers): still one
        # line and exit 1, never a traceback; the type names what to look for.
        error(f"malformed input ({type(e).__name__}: {e})")
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
