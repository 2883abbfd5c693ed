"""``ckptd serve``: the per-node daemon that owns every snapshot from hand-off to commit.

Modules, one job each:

* ``settings``: what the daemon is told (CLI flags, ``CKPTD_*`` environment variables);
* ``roots``: which job roots it serves, and the check of a request's root against them;
* ``staging``: the staging folder in shared memory: leases of buffer files, the memory budget,
  the journal that makes a restart finish (or discard) what a crash interrupted;
* ``handoff``: validation of a hand-off request and mapping of its files;
* ``jobs``: the upload through ``ckptd.persist.persist`` (the one
  commit protocol), commit watching, retries;
* ``tiers``: the memory tier: the hot copy of the newest committed step, replicas pushed to and
  received from peer daemons (``replication``), all within the staging budget; ``peers``: its
  routes; ``tierdata``: its bulk reads outside the event loop; ``sealed``: its memfd buffers;
* ``metrics``: Prometheus counters;
* ``app``: the FastAPI application (routes, auth, body limits).

The hand-off protocol, as the trainer side (``trainer_hooks.daemon_sink``) runs it, per rank:

1. ``POST /v1/leases`` (or ``/acquire`` on the lease of the previous save): the daemon grants
   staging memory under its budget (429 + ``Retry-After`` when full) and names a folder;
2. the rank creates its buffer files there and copies its snapshot into them (mapped memory:
   the snapshot copy is the only copy);
3. ``POST /v1/jobs`` describes the shards and metadata files; from the 200 on the daemon owns
   them, journals the job, uploads, writes the rank's done record, tries the commit;
4. the daemon hands the lease back (the next save reuses the same mapped files, no page faults)
   or frees it when another client waits for memory; the rank polls ``GET /v1/jobs/{id}``
   until ``committed``.
"""
