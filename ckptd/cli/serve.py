"""``ckptd serve --root URI``: run the per-node daemon (see ``ckptd.server``).

Flags override ``CKPTD_*`` environment variables (``CKPTD_ROOTS``, ``CKPTD_PORT``,
``CKPTD_STAGING_DIR``, ``CKPTD_BUDGET``, ...). SIGTERM/SIGINT stop it after running uploads
finish (up to 30 s); what is left is journalled and resumed at the next start.
"""

from __future__ import annotations

import argparse
import logging

from ckptd.cli.common import UsageError, positive_int

__all__ = ["HELP", "add_arguments", "run"]

HELP = "run the daemon that uploads and commits snapshots handed off by trainers"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--root",
        action="append",
        metavar="URI",
        help="job root to serve (repeatable); requests for roots inside it are accepted too",
    )
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8470)")
    p.add_argument("--token-file", metavar="F", help="require 'Authorization: Bearer <token in F>' (not for /healthz)")
    p.add_argument("--staging-dir", metavar="DIR", help="staging folder (default /dev/shm/ckptd, else a local folder)")
    p.add_argument(
        "--budget", metavar="SIZE", help="memory for staged snapshots, e.g. 8GiB (default: half the free space)"
    )
    p.add_argument("--upload-workers", type=positive_int, metavar="N", help="jobs uploaded at once (default 2)")
    p.add_argument(
        "--keep-last",
        type=positive_int,
        metavar="K",
        help="retention after each commit the daemon writes (default: none; trainers cannot override it)",
    )
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="default info")


def run(args: argparse.Namespace) -> int:
    import uvicorn
    from pydantic import ValidationError

    from ckptd.server.app import create_app
    from ckptd.server.settings import Settings, parse_size

    given = {
        "roots": args.root,
        "host": args.host,
        "port": args.port,
        "token_file": args.token_file,
        "staging_dir": args.staging_dir,
        "upload_workers": args.upload_workers,
        "keep_last": args.keep_last,
        "log_level": args.log_level,
    }
    try:
        if args.budget is not None:
            given["budget"] = parse_size(args.budget)
        settings = Settings(**{k: v for k, v in given.items() if v is not None})
    except (ValueError, ValidationError) as e:
        raise UsageError(" ".join(str(e).split())) from None
    if not settings.roots:
        raise UsageError("serve needs at least one --root URI (or CKPTD_ROOTS)")
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    if settings.fault_upload_delay_s:
        logging.getLogger("ckptd.server").warning(
            "fault injection on: every shard put sleeps %.2f s (CKPTD_FAULT_UPLOAD_DELAY_S, for tests only)",
            settings.fault_upload_delay_s,
        )
    try:
        app = create_app(settings)
    except (RuntimeError, OSError) as e:
        raise UsageError(str(e)) from None
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False)
    return 0
