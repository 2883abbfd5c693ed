"""The daemon's settings: CLI flags override ``CKPTD_*`` environment variables, which override
the defaults (pydantic-settings). ``CKPTD_ROOTS='["s3://bucket/jobs"]'`` is ``--root``."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings", "default_staging_dir", "group_id", "parse_size", "roots_key"]

_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(?:([KMGT])(i?)B?|B)?\s*", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """``"512MiB"`` -> bytes. Binary (KiB .. TiB) and decimal (KB .. TB, or K .. T) units."""
    if isinstance(text, int):
        return text
    m = _SIZE.fullmatch(str(text))
    if m is None:
        raise ValueError(f"invalid size {text!r} (expected e.g. 512MiB, 2GiB, 1000000)")
    number, prefix, binary = m.groups()
    factor = (1024 if binary else 1000) ** ("KMGT".index(prefix.upper()) + 1) if prefix else 1
    return int(float(number) * factor)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CKPTD_", extra="ignore")

    roots: list[str] = Field(default_factory=list, description="job roots served (--root)")
    host: str = "127.0.0.1"
    port: int = 8470
    token_file: str | None = None
    peer_key_file: str | None = Field(None, description="the key daemons sign replicas with; trainers never hold it")
    # Without a token file the daemon refuses to start unless this is set (see deploy/README.md).
    insecure_no_auth: bool = False
    staging_group: str | None = Field(
        None, description="the trainers' group: lease folders 2770 with it, else 0700 (one user for both)"
    )
    staging_dir: str | None = Field(
        None,
        description="where snapshots are staged; default /dev/shm/ckptd/roots-<hash of the roots>, else a local folder",
    )
    budget: int | None = Field(None, description="bytes of staged snapshots; default half the staging filesystem")
    socket: str | None = Field(
        None,
        description="the Unix socket trainers hand off through (the kernel names them); default /run/ckptd/ckptd.sock, "
        "or /dev/shm/ckptd/ckptd.sock where /run is not writable (CKPTD_SOCKET)",
    )
    trust_tcp: bool = Field(
        False, description="TCP callers (token holders) may use leases and hand-offs: one trusted party"
    )
    binds: list[str] = Field(default_factory=list, description="ROOT=USER: job roots bound by the operator (--bind)")
    isolate_tenants: bool | None = Field(
        None, description="per-user lease folders (needs CAP_CHOWN, CAP_DAC_OVERRIDE); default: when possible"
    )
    upload_workers: int = Field(2, ge=1, description="jobs uploaded at once")
    io_threads: int = Field(16, ge=1, description="puts in flight at once, over all jobs")
    keep_last: int | None = Field(
        None, ge=1, description="retention the daemon applies after each commit it writes (default: none)"
    )
    max_step_jump: int = Field(
        1_000_000,
        ge=0,
        description="a hand-off of a step more than this past its root's newest committed step is refused "
        "(retention would count it as the newest); 0: no bound",
    )
    upload_retries: int = Field(2, ge=0, description="re-runs of a failed upload before the job fails")
    lease_ttl_s: float = Field(60.0, gt=0, description="an idle lease whose client stopped heartbeating is freed")
    budget_stall_s: float = Field(
        30.0, gt=0, description="a wait for memory that sees no progress this long is granted"
    )
    max_body_bytes: int = Field(16 * 2**20, ge=1024)
    # Connection limits (``ckptd.server.conns``): slow or idle clients cannot starve the daemon.
    max_connections: int = Field(
        1024, ge=1, description="open connections at most (kept below the open-files limit at start)"
    )
    max_pending_per_client: int = Field(
        64, ge=1, description="connections from one address that have not yet sent a whole request"
    )
    request_timeout_s: float = Field(30.0, gt=0, description="a request's headers and body must arrive within this")
    keep_alive_s: float = Field(5.0, gt=0, description="an idle keep-alive connection is closed after this")
    housekeeping_interval_s: float = Field(
        3600.0, gt=0, description="how often incomplete S3 multipart uploads under the served roots are swept"
    )
    abort_uploads_older_than_s: float = Field(
        86400.0, ge=0, description="the sweep aborts incomplete uploads begun longer ago than this"
    )
    stall_after_s: float = Field(
        300.0, gt=0, description="the status page flags a step whose ranks wait this long for the others"
    )
    log_level: str = "info"
    # The memory tier (``server.tiers``): hot copies of committed steps, replicated to peers.
    tiers: bool = Field(True, description="keep the newest committed step's shard objects in memory")
    peers: list[str] = Field(default_factory=list, description="the node daemons of the job, in ring order (--peers)")
    advertise: str | None = Field(None, description="this daemon's URL as the peers know it (--advertise)")
    replicas: int = Field(1, ge=0, description="peers each hot copy is pushed to (the next ones in the ring)")
    ec: str | None = Field(
        None, description="k+m: memory-only parts erasure-coded over groups of k+m daemons of the ring (--ec)"
    )
    replica_timeout_s: float = Field(30.0, gt=0, description="a replica push's socket timeout")
    tenant_share: float = Field(
        0.5, gt=0, le=1, description="of the tier's objects and bytes one uid or peer may hold at most (--tenant-share)"
    )
    discover: bool = Field(
        False, description="find the peers through _daemons/ records under the served roots (--discover)"
    )
    discover_interval_s: float = Field(5.0, gt=0, description="how often this daemon renews its _daemons/ record")
    discover_ttl_s: float = Field(30.0, gt=0, description="a _daemons/ record older than this is not in the ring")
    spill_dir: str | None = Field(
        None,
        description="a local folder of this user's (not group- or other-writable) where complete memory-tier "
        "copies are also written: a restarted daemon re-adopts them (--spill-dir)",
    )
    tier_data_port: int = Field(
        0, ge=0, lt=65536, description="TCP port of the tier data path (server.tierdata); 0: any free port"
    )


def group_id(name: str | None) -> int | None:
    """The gid of ``--staging-group`` (a name or a number); None when not set."""
    if name is None:
        return None
    import grp

    try:
        return int(name) if name.isdigit() else grp.getgrnam(name).gr_gid
    except KeyError:
        raise ValueError(f"no such group {name!r} (--staging-group)") from None


def roots_key(roots: list[str]) -> str:
    """The name of the default staging folder of a daemon serving ``roots``: one folder per set
    of served roots, so a daemon never adopts the journal of a daemon that served other roots
    (their snapshots are not its to upload). Order and spelling (trailing ``/``) do not matter."""
    from ckptd.server.roots import normalize

    norm = sorted({f"{scheme}://{'/'.join(comps)}" for scheme, comps in map(normalize, roots)})
    return "roots-" + hashlib.sha256("\n".join(norm).encode()).hexdigest()[:16]


def default_staging_dir(budget: int | None, roots: list[str]) -> tuple[Path, str]:
    """(folder, why): ``<base>/roots-<hash of the served roots>``, the base /dev/shm/ckptd when
    /dev/shm exists and has room for the budget (or 1 GiB when no budget is set), else a folder
    under the user's cache."""
    shm = Path("/dev/shm")
    need = budget if budget is not None else 2**30
    key = roots_key(roots)
    if shm.is_dir() and os.access(shm, os.W_OK):
        free = shutil.disk_usage(shm).free
        if free >= need:
            return shm / "ckptd" / key, "shared memory, keyed by the served roots"
        why = f"/dev/shm has {free} bytes free, the budget needs {need}"
    else:
        why = "/dev/shm is not available"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ckptd" / "staging" / key
    return cache, f"local folder keyed by the served roots ({why})"
