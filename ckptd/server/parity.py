"""The erasure-coded memory tier (``--ec k+m``, issue 37 item 4): the ``Parity`` half of
``Tiers`` (a mixin, as ``server.replication`` is: it uses the table, lock and budget of
``Tiers``). The layout and the code are ``server.erasure``'s, in its ``per_member`` form.

Groups: the ``--peers`` ring cut into groups of n = k+m consecutive daemons (``ec_group``; the
ring's length a multiple of n, ``check_ec``). A memory-only part is never copied whole to a
peer; instead, in this order:

1. Push (``ec_shares``, called by ``Replication._push_all`` when a rank's part is held). The
   part gets a *lane* (its place among this daemon's parts of that (root, step, attempt): the
   i-th parts of the group's daemons are coded together) and is packed (its objects in key
   order). Its k blocks' shares of the m parity blocks of their stripes
   (``erasure.contribution``) go to each parity holder as one copy of kind ``parity`` over the
   replica protocol: signed with the peer key, every object with its crc32c, the whole MACed by
   ``part_mac``, with a header object naming the part (member, rank, size, object table, and
   the part's own MAC, made where it was handed off).
2. Hold (``fold_in``, at the replica's seal, after its crc32c and MAC). The holder checks the
   push is the signed sender's own part (its place in this group) and the stripes are the ones
   this daemon holds parity of, then XORs each share into its parity block: one ``Copy`` of
   kind ``parity`` per (lane, stripe, row), charged to the staging budget, kept by the
   retention rule with its step (``Tiers._retain``), dropped by a fence. A slot folded twice
   would cancel itself: a repeated push of a slot is ignored. So a node holds its own parts and
   m parity blocks per lane: (1+m/k)x its share when the parts are even.
3. Rebuild (``rebuild``: ``POST /v1/tiers/rebuild``, asked by a restoring rank 0 before it
   chooses a memory-only step, ``trainer_hooks.memsteps``). The daemon asks every member of its
   group what it holds (``GET /v1/tiers/ec``, signed); a member that does not answer is lost.
   With at most m lost, for each (step, attempt, lane) a lost member gave shares to (its header
   read from a surviving holder), ``erasure.recover`` reads the blocks ``plan`` names, and only
   those (``GET /v1/tiers/ec/block``), and rebuilds the lost parts. A rebuilt part is held only
   if every object matches the crc32c of its table, the part its MAC and its done record's pins
   (``Tiers.check_whole``, the spill's check): then as a replica from the lost member, served as any, and the
   restore checks every chunk against its crc32c and pins again. Reed-Solomon detects nothing
   itself: a wrong or stale parity block rebuilds bytes that fail these checks, never a part
   that is served. More than m lost: nothing is rebuilt, the restore falls back to the
   persisted step.
"""

from __future__ import annotations

import json
import logging
from urllib.parse import urlencode

import numpy as np

from ckptd import manifest as mf
from ckptd.codec import crc32c
from ckptd.errors import CheckpointError
from ckptd.server.erasure import Stripes, contribution, fold, parse_ec, recover
from ckptd.server.replication import EC_DIR, MEMORY_ONLY, PARITY, Copy, _request, charge, check_objects, part_mac
from ckptd.server.sealed import new_buffer, seal

__all__ = ["HEADER", "MAX_LANES", "Parity", "check_ec", "ec_group"]

log = logging.getLogger("ckptd.tiers")

HEADER = "head"  # the header object of a parity push (module doc, 1)
MAX_LANES = 1 << 12  # parts of one step one daemon codes at most
EC_SOURCE = "ec"  # the source of a parity block in the table: "ec <stripe>.<row>"


def check_ec(spec: str, replicas: int, peers: list[str], me: str | None, peer_key, discover: bool) -> tuple[int, int]:
    """(k, m) of ``--ec spec``, or ValueError (one line) for settings it does not go with."""
    k, m = parse_ec(spec)
    if replicas > 0:
        raise ValueError(f"--ec {spec} and --replicas {replicas} exclude each other: parity replaces copies")
    if discover or not peers or not me:
        raise ValueError(f"--ec {spec} needs the ring as --peers URL,... and this daemon's place in it (--advertise)")
    if peer_key is None:
        raise ValueError(f"--ec {spec} needs --peer-key-file: daemons sign and MAC their parity with it")
    ring = [p.rstrip("/") for p in peers]
    if me.rstrip("/") not in ring or len(ring) % (k + m):
        raise ValueError(
            f"--ec {spec}: the --peers ring ({len(ring)} daemons) must name this daemon (--advertise) and be "
            f"a multiple of {k + m} daemons (groups of k+m)"
        )
    return k, m


def ec_group(peers: list[str], me: str, n: int) -> tuple[tuple[str, ...], int]:
    """The members of ``me``'s group of ``n`` consecutive daemons of the ring, and its index in it."""
    ring = [p.rstrip("/") for p in peers]
    i = ring.index(me.rstrip("/"))
    return tuple(ring[i - i % n : i - i % n + n]), i % n


def _pack(objects: dict) -> tuple[bytes, list]:
    """A part's objects in key order as one buffer, and its table ([key, size, crc32c] each)."""
    keys = sorted(objects)
    table = [[k, len(objects[k]), crc32c(objects[k])] for k in keys]
    return b"".join(memoryview(objects[k]).cast("B") for k in keys), table


def _unpack(packed, table: list) -> dict[str, bytearray]:
    """``_pack``'s inverse; ValueError unless the table's sizes add up to the buffer's."""
    if not isinstance(table, list) or sum(int(n) for _, n, _ in table) != len(packed):
        raise ValueError("a rebuilt part does not match its object table")
    out, pos = {}, 0
    for key, n, _ in table:
        out[str(key)] = bytearray(packed[pos : pos + int(n)])
        pos += int(n)
    return out


def _int(x, hi: int) -> int:
    if type(x) is not int or not 0 <= x < hi:
        raise ValueError(f"malformed parity header field {x!r}")
    return x


class Parity:
    """The parity half of ``Tiers`` (module doc)."""

    ec: tuple[int, int] | None = None  # (k, m) with --ec

    def _ec_members(self) -> tuple[tuple[str, ...], int]:
        k, m = self.ec  # type: ignore[misc]
        return ec_group(self.peers, self.me, k + m)

    # ---------------------------------------------------------------------------- 1. push

    def ec_shares(self, c: Copy) -> dict[str, Copy]:
        """Holder URL -> the ``parity`` copy carrying own memory-only part ``c``'s shares for it."""
        k, m = self.ec  # type: ignore[misc]
        members, i = self._ec_members()
        with self._lock:
            objects = dict(c.objects)
        packed, table = _pack(objects)
        st = Stripes(members, k, m, tuple(len(packed) if j == i else 0 for j in range(k + m)), per_member=True)
        folder = f"{mf.step_dir(c.step)}/{EC_DIR}/{c.lane}"
        head = {"member": i, "members": list(members), "rank": c.rank, "size": len(packed), "table": table}
        head = json.dumps(head | {"mac": c.mac}).encode()
        out: dict[str, Copy] = {}
        view = memoryview(packed)
        for b in range(k):
            start, length = st.span(i, b)
            for h, s, j, share in contribution(st, i, b, view[start : start + length]):
                x = out.get(members[h])
                if x is None:
                    x = out[members[h]] = Copy(c.root, c.step, c.attempt, c.source, c.rank, kind=PARITY)
                    x.objects[f"{folder}/{HEADER}"] = head
                x.objects[f"{folder}/{s}.{j}"] = share.tobytes()
        for x in out.values():
            x.mac = part_mac(self.peer_key, c.root, self.bound_uid(c.root), c.step, c.attempt, c.rank, x.objects)
        return out

    # ---------------------------------------------------------------------------- 2. hold

    def fold_in(self, c: Copy) -> None:
        """Fold a sealed (crc32c and MAC checked) parity push ``c`` into this daemon's parity
        blocks; ValueError if it is not one this daemon holds parity for (module doc, 2)."""
        if self.ec is None:
            raise ValueError("this daemon keeps no erasure-coded tier (--ec)")
        k, m = self.ec
        members, me = self._ec_members()
        prefix = f"{mf.step_dir(c.step)}/{EC_DIR}/"
        heads = [key for key in c.objects if key.endswith(f"/{HEADER}")]
        if len(heads) != 1:
            raise ValueError("a parity push has one header")
        lane_text = heads[0][len(prefix) :].split("/")[0]
        try:
            lane = _int(int(lane_text) if lane_text.isdigit() else -1, MAX_LANES)
            head = json.loads(bytes(c.objects[heads[0]]))
            i = _int(head["member"], k + m)
            if head["members"] != list(members) or members[i] != c.source or head["rank"] != c.rank:
                raise ValueError(f"not {c.source}'s part in this daemon's group {list(members)}")
            size = _int(head["size"], 1 << 40)
            check_objects(c.step, MEMORY_ONLY, [(key, n, crc) for key, n, crc in head["table"]])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed parity push: {e}") from None
        st = Stripes(members, k, m, tuple(size if j == i else 0 for j in range(k + m)), per_member=True)
        shares = {}
        for b in range(k):
            s = st.stripe_of(i, b)
            for j, h in enumerate(st.holders(s)):
                if h == me:
                    want = st.span(i, b)[1]
                    shares[(s, j, st.contributors(s).index(i))] = (f"{prefix}{lane}/{s}.{j}", want + (want & 1))
        if {key for key, _ in shares.values()} | {heads[0]} != set(c.objects):
            raise ValueError("a parity push carries other shares than the stripes this daemon holds")
        if any(len(c.objects[key]) != n for key, n in shares.values()):
            raise ValueError("a parity share of the wrong length")
        total = sum(charge(n) for _, n in shares.values())
        if not self.staging.reserve(total):
            raise ValueError("not kept: no room in the staging budget")
        used = 0
        with self._lock:
            for (s, j, t), (key, _) in shares.items():
                k_ = (c.root, c.step, c.attempt, lane, f"{EC_SOURCE} {s}.{j}")
                p = self._held.get(k_)
                if p is None:
                    p = self._held[k_] = Copy(c.root, c.step, c.attempt, k_[4], lane, c.source, kind=PARITY)
                    p.objects["parity"], p.complete, p.ec = bytearray(), True, {"stripe": s, "row": j, "slots": {}}
                if t in p.ec["slots"]:
                    continue  # a repeated push: folding it again would cancel it
                share = c.objects[key]
                if len(share) > len(p.objects["parity"]):
                    grown = bytearray(len(share))
                    grown[: len(p.objects["parity"])] = p.objects["parity"]
                    p.objects["parity"] = grown
                    add = charge(len(grown)) - p.charged
                    p.bytes, p.charged, used = len(grown), p.charged + add, used + add
                fold(np.frombuffer(p.objects["parity"], np.uint8), share)
                p.ec["slots"][t] = head
            release = self._retain(c.root, PARITY)
        self.staging.unreserve(total - used)
        self._release(release)

    # -------------------------------------------------------------------------- serving

    def ec_holdings(self, root: str) -> dict:
        """What ``GET /v1/tiers/ec`` answers (to a signed peer of the group): this daemon's own
        memory-only parts of ``root`` (step, attempt, lane, rank, packed size) and its parity
        blocks (step, attempt, lane, stripe, row, each folded slot's header)."""
        with self._lock:
            own = [c for c in self._complete() if (c.root, c.kind, c.source) == (root, MEMORY_ONLY, "self")]
            parity = [c for c in self._complete() if c.root == root and c.kind == PARITY]
            return {
                "parts": [
                    {"step": c.step, "attempt": c.attempt, "lane": c.lane, "rank": c.rank, "size": c.bytes} for c in own
                ],
                "parity": [
                    {"step": c.step, "attempt": c.attempt, "lane": c.rank, **{f: c.ec[f] for f in ("stripe", "row")}}
                    | {"slots": {str(t): h for t, h in c.ec["slots"].items()}}
                    for c in parity
                ],
            }

    def ec_block(self, root: str, step: int, attempt: str, lane: int, stripe: int, num: int) -> bytes | None:
        """Block ``num`` of ``stripe`` this daemon holds for (root, step, attempt, lane): a data
        block of its own part (num < k), or its parity row num-k; None when it holds none."""
        k, m = self.ec  # type: ignore[misc]
        members, me = self._ec_members()
        with self._lock:
            if num >= k:
                p = self._held.get((root, step, attempt, lane, f"{EC_SOURCE} {stripe}.{num - k}"))
                return None if p is None or p.dropped else bytes(p.objects["parity"])
            own = [
                c
                for c in self._complete()
                if (c.root, c.step, c.attempt, c.lane, c.kind, c.source)
                == (root, step, attempt, lane, MEMORY_ONLY, "self")
            ]
            objects = dict(own[0].objects) if own else None
        if objects is None:
            return None
        packed, _ = _pack(objects)
        st = Stripes(members, k, m, tuple(len(packed) if j == me else 0 for j in range(k + m)), per_member=True)
        if st.stripe_of(me, num) != stripe:
            raise ValueError(f"block {num} of this daemon's part is not in stripe {stripe}")
        start, length = st.span(me, num)
        return packed[start : start + length]

    # --------------------------------------------------------------------------- 3. rebuild

    def rebuild(self, root: str) -> int:
        """Rebuild the parts of ``root`` the lost members of this daemon's group held (module
        doc, 3) and hold them as replicas; returns how many parts were rebuilt."""
        if self.ec is None:
            return 0
        k, m = self.ec
        members, me = self._ec_members()
        answers, lost = {me: self.ec_holdings(root)}, []
        for idx, url in enumerate(members):
            if idx == me:
                continue
            try:
                conn = self._dial(url)
                try:
                    answers[idx] = json.loads(_request(conn, "GET", "/v1/tiers/ec?" + urlencode({"root": root}), None))
                finally:
                    conn.close()
            except Exception as e:  # noqa: BLE001 - a member that is gone is what this is for
                log.info("erasure-coded tier: %s of the group does not answer (%s): counted lost", url, e)
                lost.append(idx)
        if not lost:
            return 0
        if len(lost) > m:
            log.warning(
                "erasure-coded tier: %d of the %d daemons of the group are lost, at most %d can be rebuilt: "
                "%s's memory-only parts on them are gone",
                len(lost),
                k + m,
                m,
                root,
            )
            return 0
        heads: dict[tuple[int, str, int], dict[int, dict]] = {}
        sizes: dict[tuple[int, str, int], dict[int, int]] = {}
        for idx, ans in answers.items():
            try:
                for p in ans["parity"]:
                    for head in p["slots"].values():
                        heads.setdefault((p["step"], p["attempt"], p["lane"]), {})[head["member"]] = head
                for p in ans["parts"]:
                    sizes.setdefault((p["step"], p["attempt"], p["lane"]), {})[idx] = p["size"]
            except (KeyError, TypeError, AttributeError) as e:
                log.warning("erasure-coded tier: %s answered what it holds malformed (%s)", members[idx], e)
        rebuilt = 0
        for (step, attempt, lane), by_member in sorted(heads.items(), reverse=True):
            gone = [i for i in lost if i in by_member]
            with self._lock:
                gone = [i for i in gone if (root, step, attempt, by_member[i]["rank"], members[i]) not in self._held]
            if not gone:
                continue
            try:
                live = sizes.get((step, attempt, lane), {})
                st = Stripes(
                    members,
                    k,
                    m,
                    tuple(by_member[i]["size"] if i in gone else live.get(i, 0) for i in range(k + m)),
                    per_member=True,
                )
                where = (st, root, step, attempt, lane)
                parts = recover(st, lost, lambda member, s, num, where=where: self._ec_read(*where, member, s, num))
                for i in gone:
                    self._hold_rebuilt(root, step, attempt, members[i], by_member[i], parts[i])
                    rebuilt += 1
            except (ValueError, KeyError, TypeError, CheckpointError, RuntimeError, OSError) as e:
                log.warning(
                    "erasure-coded tier: memory-only step %d of %s (lane %d) not rebuilt: %s", step, root, lane, e
                )
        return rebuilt

    def _ec_read(self, st: Stripes, root: str, step: int, attempt: str, lane: int, member: int, s: int, num: int):
        """``recover``'s reader: block ``num`` of stripe ``s`` from ``member`` (a short parity
        block padded with the zeros no share reached)."""
        members, me = self._ec_members()
        if member == me:
            raw = self.ec_block(root, step, attempt, lane, s, num)
        else:
            q = {"root": root, "step": step, "attempt": attempt, "lane": lane, "stripe": s, "num": num}
            conn = self._dial(members[member])
            try:
                raw = _request(conn, "GET", "/v1/tiers/ec/block?" + urlencode(q), None)
            finally:
                conn.close()
        if raw is None:
            raise ValueError(f"{members[member]} holds no block {num} of stripe {s}")
        if num >= st.k and len(raw) < st.length(s):
            raw = bytes(raw) + bytes(st.length(s) - len(raw))
        return raw

    def _hold_rebuilt(self, root: str, step: int, attempt: str, source: str, head: dict, packed) -> None:
        """Hold a rebuilt part as a replica from ``source`` once every check passes (module doc, 3)."""
        rank = _int(head["rank"], 1 << 24)
        objects = _unpack(packed, head["table"])
        expected = check_objects(step, MEMORY_ONLY, head["table"])
        try:
            self.check_whole(root, None, step, attempt, rank, MEMORY_ONLY, expected, objects, head["mac"])
        except ValueError as e:
            raise ValueError(f"rebuilt rank {rank}'s part (a stale or wrong parity block?): {e}") from None
        c = Copy(root, step, attempt, source, rank, source, kind=MEMORY_ONLY, mac=head["mac"])
        c.charged = sum(charge(len(b), len(key)) for key, b in objects.items())
        if not self.staging.reserve(c.charged):
            raise ValueError("the rebuilt part does not fit the staging budget")
        bufs = {}
        for key, b in objects.items():
            buf = new_buffer(len(b))
            buf[:] = b
            bufs[key] = seal(buf)
        c.objects, c.bytes, c.complete = bufs, sum(len(b) for b in objects.values()), True
        with self._lock:
            self._held[(root, step, attempt, rank, source)] = c
            self.counters["replicas_received"] += 1
        log.info(
            "erasure-coded tier: rank %d's part of memory-only step %d of %s rebuilt (%d bytes)",
            rank,
            step,
            root,
            c.bytes,
        )
