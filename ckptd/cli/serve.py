"""``ckptd serve --root URI``: run the per-node daemon (see ``ckptd.server``).

Flags override ``CKPTD_*`` environment variables (``ckptd.server.settings``). SIGTERM/SIGINT stop
it after running uploads finish (up to 30 s); what is left is journalled and resumed at the next
start. The rules it starts under (docs/security.md, "Daemon"): no token file without
``--insecure-no-auth`` (logged as a WARNING), no token file its group or others can write (exit
2), the port bound before anything else (a taken port is one error line and exit 1), connection
limits (``ckptd.server.conns``), log messages escaped to one line each, and a Unix socket where
the kernel names each caller (``ckptd.server.tenancy``).
"""

from __future__ import annotations

import argparse
import logging
import socket

from ckptd.cli.common import UsageError, positive_int, printable
from ckptd.errors import CheckpointError

__all__ = ["HELP", "OneLineFormatter", "add_arguments", "run"]

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
    p.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="serve without a token: any local user (and any host reaching --host) may hand off and commit",
    )
    p.add_argument(
        "--staging-group",
        metavar="GROUP",
        help="trainers' group when they run as other users: lease folders 2770 with it (default: 0700)",
    )
    p.add_argument(
        "--staging-dir",
        metavar="DIR",
        help="staging folder (default /dev/shm/ckptd/roots-<hash of the --root set>, else a local folder)",
    )
    p.add_argument(
        "--socket",
        metavar="PATH",
        help="Unix socket for trainers, which names each caller's uid "
        "(default CKPTD_SOCKET, else /run/ckptd/ckptd.sock, or /dev/shm/ckptd/ckptd.sock where /run is not writable)",
    )
    p.add_argument(
        "--trust-tcp",
        action="store_true",
        help="let TCP callers (with the token) use leases and hand-offs: everyone who can connect is one party",
    )
    p.add_argument(
        "--bind",
        action="append",
        metavar="ROOT=USER",
        help="the job root ROOT (and every root below it) belongs to USER (repeatable; overrides first use)",
    )
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
    p.add_argument(
        "--max-step-jump",
        type=int,
        metavar="N",
        help="refuse a hand-off of a step more than N past its root's newest committed step "
        "(default CKPTD_MAX_STEP_JUMP, else 1000000; 0: no bound)",
    )
    p.add_argument(
        "--max-connections",
        type=positive_int,
        metavar="N",
        help="open client connections at most (default 1024, kept below the open-files limit)",
    )
    p.add_argument(
        "--peers",
        metavar="URL,...",
        help="the node daemons of the job in ring order (may include this one): hot copies are replicated to them",
    )
    p.add_argument(
        "--peer-key-file",
        metavar="F",
        help="key the daemons of a ring sign replicas with (0600, this user's; trainers never hold it)",
    )
    p.add_argument("--advertise", metavar="URL", help="this daemon's URL as its peers know it (its place in --peers)")
    p.add_argument(
        "--discover",
        action="store_true",
        help="find the peers through _daemons/ records under the roots (with --advertise and a token; not --peers)",
    )
    p.add_argument("--replicas", type=int, metavar="K", help="peers each hot copy is pushed to (default 1; 0: none)")
    p.add_argument(
        "--ec",
        metavar="K+M",
        help="erasure-code memory-only steps over groups of K+M daemons of --peers instead of copying them "
        "(any M of a group lost; needs --peer-key-file; not with --replicas K > 0)",
    )
    p.add_argument(
        "--tenant-share",
        type=float,
        metavar="F",
        help="of the memory tier's objects and bytes one uid or peer may hold at most (default 0.5; 1: no limit)",
    )
    p.add_argument("--no-tiers", action="store_true", help="keep no hot copy of committed steps in memory")
    p.add_argument(
        "--spill-dir",
        metavar="DIR",
        help="also write complete memory-tier copies to this local folder (yours, mode 700): "
        "a restarted daemon checks and serves them again (CKPTD_SPILL_DIR)",
    )
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="default info")


def run(args: argparse.Namespace) -> int:
    import uvicorn
    from pydantic import ValidationError

    from ckptd.server.app import create_app
    from ckptd.server.conns import ConnectionLimits, guarded_protocol
    from ckptd.server.settings import Settings, parse_size
    from ckptd.server.tenancy import listen_unix, peer_protocol, release_unix

    # Flags named as the settings they set, where given (a store_true flag left False, like a flag
    # left None, keeps the environment's value); the others below.
    given = {k: v for k, v in vars(args).items() if k in Settings.model_fields and v is not None and v is not False}
    given |= {
        "roots": args.root,
        "binds": args.bind,
        "peers": [u.strip() for u in args.peers.split(",") if u.strip()] if args.peers else None,
        "tiers": False if args.no_tiers else None,
    }
    try:
        if args.budget is not None:
            given["budget"] = parse_size(args.budget)
        settings = Settings(**{k: v for k, v in given.items() if v is not None})
    except (ValueError, ValidationError) as e:
        raise UsageError(" ".join(str(e).split())) from None
    if not settings.roots:
        raise UsageError("serve needs at least one --root URI (or CKPTD_ROOTS)")
    if settings.token_file is None and not settings.insecure_no_auth:
        raise UsageError(
            "refusing to serve without authentication: give --token-file F (a token readable only by the "
            "daemon and the trainers), or --insecure-no-auth to let anyone who can connect hand off and commit"
        )
    logging.basicConfig(level=settings.log_level.upper(), force=True)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(OneLineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log = logging.getLogger("ckptd.server")
    if settings.token_file is None:
        log.warning(
            "INSECURE: no authentication (--insecure-no-auth): every local user and every host that reaches "
            "%s:%d can hand off snapshots, commit steps and read checkpoint metadata",
            settings.host,
            settings.port,
        )
    sock = _listen(settings.host, settings.port)
    try:
        app = create_app(settings)
    except (RuntimeError, OSError, ValueError) as e:  # ValueError: the token file (read_token)
        sock.close()
        raise UsageError(str(e)) from None
    limits = ConnectionLimits(
        _connection_cap(settings.max_connections, log),
        settings.max_pending_per_client,
        settings.request_timeout_s,
        app.state.token,
    )
    metrics = app.state.daemon.metrics
    metrics.gauge("ckptd_connections", "open client connections", lambda: len(limits.open))
    for name, attr, text in (
        ("ckptd_connections_evicted", "evicted", "pending connections closed to make room (slow or idle clients)"),
        ("ckptd_connections_timed_out", "timed_out", "connections closed for not sending a whole request in time"),
    ):
        metrics.gauge(name, text, lambda a=attr: getattr(limits, a))
    daemon = app.state.daemon
    try:
        group = daemon.staging.group  # the socket's folder, if the daemon makes it, is reached as the staging folder
        mode = 0o711 if daemon.staging.private else 0o710 if group is not None else 0o700
        unix = listen_unix(daemon.socket_path, mode, group)
    except (OSError, RuntimeError) as e:
        sock.close()
        daemon.staging.close()
        raise UsageError(f"cannot listen on {daemon.socket_path}: {getattr(e, 'strerror', None) or e}") from None
    log.info("trainers hand off through unix://%s (the kernel names each caller)", daemon.socket_path)
    tier_data = None
    if settings.tiers:
        from ckptd.server.tierdata import TierData

        try:
            tier_data = TierData(app.state.tiers, daemon, app.state.token, settings, limits.max_connections).start()
        except (OSError, RuntimeError) as e:
            sock.close()
            unix.close()
            release_unix(daemon.socket_path)
            daemon.staging.close()
            raise UsageError(f"cannot listen for tier data: {getattr(e, 'strerror', None) or e}") from None
        app.state.tiers.data_endpoint = tier_data.endpoint
        metrics.gauge("ckptd_tier_data_connections", "open tier data-path connections", lambda: tier_data.connections)
        metrics.gauge(
            "ckptd_tier_data_refused", "tier data-path connections refused over the cap", lambda: tier_data.refused
        )
        metrics.gauge(
            "ckptd_tier_data_evicted",
            "pending tier data-path connections closed (room, or late)",
            lambda: tier_data.evicted,
        )
        log.info("tier data on port %d and unix://%s", tier_data.port, tier_data.socket_path)
    if settings.trust_tcp and settings.token_file is not None:
        log.warning(
            "--trust-tcp: every holder of the token who reaches %s:%d may use leases and hand-offs for any job "
            "root; tenants of this node are one trusted party",
            settings.host,
            settings.port,
        )
    config = uvicorn.Config(
        app,
        log_level=settings.log_level,
        access_log=False,
        http=peer_protocol(guarded_protocol(limits)),
        timeout_keep_alive=settings.keep_alive_s,
    )
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock, unix])
    finally:
        if tier_data is not None:
            tier_data.close()
        release_unix(daemon.socket_path)
    return 0 if server.started else 1


# Open files kept for everything but client connections: staged files, uploads, stores, logs.
FD_RESERVE = 256


def _connection_cap(wanted: int, log: logging.Logger) -> int:
    """Keep ``FD_RESERVE`` descriptors of the open-files limit (which ``create_app`` raised to the
    hard one: ``server.capacity.raise_open_files``) for everything but connections: more
    connections than that would starve uploads of files and stop the server accepting anyone
    (``ckptd.server.conns``)."""
    from ckptd.server import capacity

    soft = capacity.describe()["open_files"]  # None: unlimited
    cap = wanted if soft is None else min(wanted, max(16, soft - FD_RESERVE))
    if cap < wanted:
        log.warning("at most %d connections (open-files limit %d); --max-connections asked for %d", cap, soft, wanted)
    return cap


def _listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (uvicorn listens on it); one clear error (exit 1) if taken."""
    sock = None
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.set_inheritable(True)
        return sock
    except OSError as e:
        if sock is not None:
            sock.close()
        raise CheckpointError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


class OneLineFormatter(logging.Formatter):
    """Every log message is one line: job roots, keys and error texts come from clients and
    storage, so control characters in the message (a root named ``x\\n... INFO forged``, an escape
    sequence) are written as escapes (``printable``). A traceback keeps its own lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = printable(record.message)
        return super().formatMessage(record)
