"""``ckptd serve``: the per-node daemon that owns every snapshot from hand-off to commit.

Modules, one job each (its docstring says which): ``settings``, ``roots``, ``staging`` (leases,
budget, journal), ``handoff``, ``jobs`` (upload, commit watch), ``tiers`` (the memory tier, with
``replication``, ``peers``, ``tierdata`` and ``sealed``), ``metrics`` and ``app`` (FastAPI).

The hand-off protocol, per rank: ``trainer_hooks.daemon_sink`` (the trainer's side) and
docs/architecture.md ("Who calls ``persist``", through the daemon).
"""
