"""``python -m tests.security.cli_as USER ARGV...``: the ``ckptd`` CLI run in-process as the local
user USER, for ``test_tenancy.py``.

Started as root: it imports the CLI and every module of ``ckptd`` and ``storage_backends`` it
may load lazily (the interpreter and its packages live under ``/root``, which other users cannot
read), then drops to USER for good (``tenant.drop_to``: groups, gid, uid) and runs ``ckptd
ARGV``. From there on every file it opens, renames or deletes is opened as USER; its exit status
is the CLI's.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pkgutil
import sys

import ckptd
import storage_backends
from ckptd.cli.main import main
from tests.security.tenant import drop_to


def _import_all() -> None:
    for pkg in (ckptd, storage_backends):
        for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if not m.name.startswith("ckptd.server"):
                with contextlib.suppress(ImportError):
                    importlib.import_module(m.name)


if __name__ == "__main__":
    _import_all()
    drop_to(sys.argv[1])
    os.umask(0o022)
    os.chdir("/")
    sys.exit(main(sys.argv[2:]))
