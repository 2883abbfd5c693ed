"""Erasure coding of the memory tier across nodes (issue 37 item 4, ``--ec k+m``): the pure code
(the layout, encoding shares, rebuilding lost parts) that ``server.parity`` wires into the daemon.

Today (``server.replication``) each daemon pushes its node's part of a step whole to ``k`` ring
successors: (1+k)x its part held per node, any k node losses survived. Here a *group* of
``n = k+m`` daemons codes their parts together with a Reed-Solomon code (``zfec``, systematic,
GF(2^8) with the polynomial 0x11d), REFT-style: (1+m/k)x held per node, any ``m`` node losses
survived, the same bytes sent per node as m-way replication.

Layout (``Stripes``, deterministic from the ordered members and the part sizes; the same for
every step, since every member already holds the same share). Member ``i``'s part ``P_i`` is
cut into ``k`` blocks of ``block = ceil(max_j |P_j| / k)`` bytes (the last ones shorter or
empty; the zero padding up to ``block`` is implied, never stored nor sent). There are ``n``
stripes, each a codeword of ``k`` data slots and ``m`` parity rows:

- stripe ``s``'s parity row ``j`` is held by member ``(s + j) % n`` (``holders``);
- member ``i``'s block ``b`` is slot ``b`` of stripe ``(i - m - b) % n`` (``stripe_of``).

So in every stripe ``m`` members hold parity and the ``k`` others give one data block each;
each member is a data contributor in ``k`` stripes (its ``k`` blocks) and a parity holder in
``m``: it holds ``|P_i| + m * block`` (``held``), (1+m/k)x its part when the parts are equal.
Any ``m`` lost members take at most ``m`` of the ``n`` blocks of a stripe: every stripe keeps
``k``, enough to decode it.

Parts of different lengths are padded (implicitly) to the group's largest: a member whose part
is smaller than the largest still holds parity blocks of the largest's ``block``. For the even
parts of FSDP/ZeRO (within a few KiB) that costs nothing measurable; a group whose parts differ
a lot (rank 0 holding extra state) pays ``m * (max - |P_i|) / k`` per member. Sizing each stripe
by its own contributors' largest block would save little (a stripe has ``k`` of the ``n``
members, so its largest is nearly always the group's) for a layout every reader must re-derive.

Encoding, the linearity trick. RS parity is linear over GF(2^8): parity row ``j`` of a stripe is
``XOR over slots t of c[j][t] * D_t``. So a data member computes its block's share of each of
the ``m`` parity blocks alone (``contribution``: the library's encoding of the block in its slot
and zero blocks elsewhere; computed here by multiplying with a table read off the library's own
encoder, ``_Code.table``, 3-5x faster here than encoding the zero blocks, and checked equal to it in the
tests) and sends each share to the holder, which XORs shares into its parity buffer as they
arrive, in any order (``fold``). No member needs another's data; each sends ``m * |P_i|`` bytes,
as m-way replication does, and holds ``m * block`` of parity.

A loss. A lost member's part is its ``k`` data blocks, in ``k`` distinct stripes; only those
stripes are decoded (``plan``), each from ``k`` surviving blocks of it (data blocks first: a
surviving data block is read as is, the decode touches only what is missing); stripes where the
lost member held only parity lose no part and are not decoded (their parity is rebuilt when a
new group forms: re-encoding, not this module). ``recover`` reads the surviving blocks through
a callback (the restore would fetch them from the surviving daemons' tier routes) and returns
the lost members' parts. More than ``m`` losses in one stripe are refused with one error before
anything is read.

Wired into the daemon by ``server.parity`` (``ckptd serve --ec k+m``), in the ``per_member``
form: groups of ``n`` consecutive daemons of the ``--peers`` ring (its length a multiple of
``n``), a ``parity`` copy kind in ``Tiers``' table, and a rebuild by a restoring rank's daemon.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import zfec

__all__ = ["MAX_GROUP", "MAX_PART_BYTES", "Stripes", "contribution", "fold", "parse_ec", "plan", "recover"]

MAX_GROUP = 32  # k+m at most: zfec allows 256, but a group decodes from k daemons and m/k gains little past 32
MAX_PART_BYTES = 1 << 40  # a node's part of one step at most (1 TiB): a size past it is hostile


def parse_ec(spec: str) -> tuple[int, int]:
    """``"k+m"`` (``--ec 4+2``) -> (k, m); ValueError unless 1 <= k, 1 <= m, k+m <= MAX_GROUP."""
    head, sep, tail = str(spec).partition("+")
    if not sep or not head.strip().isdigit() or not tail.strip().isdigit():
        raise ValueError(f"--ec must be k+m (for example 4+2), got {spec!r}")
    k, m = int(head), int(tail)
    _check_code(k, m)
    return k, m


def _check_code(k: int, m: int) -> None:
    if not (isinstance(k, int) and isinstance(m, int) and k >= 1 and m >= 1 and k + m <= MAX_GROUP):
        raise ValueError(f"an erasure code needs k >= 1, m >= 1 and k+m <= {MAX_GROUP}, got k={k!r} m={m!r}")


class _Code:
    """One (k, m) zfec code: its encoder, decoder and multiplication tables read off the encoder
    (built on first use, 128 KiB each, k*m at most: 1 MiB for 4+2, 32 MiB for the largest group)."""

    _cache: dict[tuple[int, int], _Code] = {}

    def __init__(self, k: int, m: int):
        self.k, self.m = k, m
        self.encoder = zfec.Encoder(k, k + m)
        self.decoder = zfec.Decoder(k, k + m)
        self._tables: dict[tuple[int, int], np.ndarray] = {}

    @classmethod
    def of(cls, k: int, m: int) -> _Code:
        code = cls._cache.get((k, m))
        if code is None:
            code = cls._cache.setdefault((k, m), cls(k, m))
        return code

    def table(self, row: int, slot: int) -> np.ndarray:
        """x -> c[row][slot] * x over GF(2^8), for two bytes at once (65536 uint16 entries): the
        library's encoding of the 256 byte values in ``slot`` with zero blocks elsewhere, so the
        field and its coefficients are zfec's own."""
        t = self._tables.get((row, slot))
        if t is None:
            blocks = [bytes(256)] * self.k
            blocks[slot] = bytes(range(256))
            (out,) = self.encoder.encode(blocks, [self.k + row])
            t8 = np.frombuffer(out, np.uint8)
            x = np.arange(65536)
            t = t8[x & 255].astype(np.uint16) | (t8[x >> 8].astype(np.uint16) << 8)
            t = self._tables.setdefault((row, slot), t)
        return t


@dataclass(frozen=True)
class Stripes:
    """The stripe layout of one step of one group (module doc): ``members`` in ring order,
    ``sizes[i]`` the bytes of member ``i``'s part."""

    members: tuple[str, ...]
    k: int
    m: int
    sizes: tuple[int, ...]
    # Each member's part cut by its own size (``block_of``), a stripe as long as its longest
    # contributor's block (``length``): what the daemon uses (``server.parity``), since a member
    # then codes its part alone, without first learning the others' sizes (no round between
    # daemons per step); the parity a holder keeps is as long as the longest share it folded.
    per_member: bool = False

    def __post_init__(self):
        _check_code(self.k, self.m)
        n = self.k + self.m
        if len(self.members) != n or len(set(self.members)) != n:
            raise ValueError(f"a {self.k}+{self.m} group has {n} distinct members, got {len(self.members)}")
        if len(self.sizes) != n:
            raise ValueError(f"a {self.k}+{self.m} group needs {n} part sizes, got {len(self.sizes)}")
        for member, size in zip(self.members, self.sizes, strict=True):
            if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_PART_BYTES:
                raise ValueError(f"part size of {member!r} must be 0..{MAX_PART_BYTES} bytes, got {size!r}")

    @property
    def n(self) -> int:
        return self.k + self.m

    @cached_property
    def block(self) -> int:
        """Bytes of every block of every stripe: the largest part over ``k``, rounded up (even)."""
        b = -(-max(self.sizes) // self.k)
        return b + (b & 1)  # even: the multiplication tables take two bytes at a time

    def block_of(self, i: int) -> int:
        """Bytes of member ``i``'s blocks: ``block``, or with ``per_member`` its own part over ``k`` (even)."""
        if not self.per_member:
            return self.block
        b = -(-self.sizes[i] // self.k)
        return b + (b & 1)

    def length(self, s: int) -> int:
        """Bytes of stripe ``s``'s blocks (its parity): the longest block of its contributors."""
        if not self.per_member:
            return self.block
        return max(self.block_of(c) for c in self.contributors(s))

    def stripe_of(self, i: int, b: int) -> int:
        """The stripe whose slot ``b`` is member ``i``'s block ``b``."""
        return (i - self.m - b) % self.n

    def holders(self, s: int) -> tuple[int, ...]:
        """The members holding stripe ``s``'s parity rows 0..m-1."""
        return tuple((s + j) % self.n for j in range(self.m))

    def contributors(self, s: int) -> tuple[int, ...]:
        """The members giving stripe ``s``'s data slots 0..k-1."""
        return tuple((s + self.m + t) % self.n for t in range(self.k))

    def parity_of(self, i: int) -> tuple[tuple[int, int], ...]:
        """The (stripe, row) parity blocks member ``i`` holds."""
        return tuple(((i - j) % self.n, j) for j in range(self.m))

    def held(self, i: int) -> int:
        """Bytes member ``i`` holds: its part and its ``m`` parity blocks."""
        return self.sizes[i] + sum(self.length(s) for s, _ in self.parity_of(i))

    def span(self, i: int, b: int) -> tuple[int, int]:
        """(start, length) of block ``b`` in member ``i``'s part (length < ``block`` at its end)."""
        block = self.block_of(i)
        start = min(b * block, self.sizes[i])
        return start, min(block, self.sizes[i] - start)


def _as_bytes(buf) -> np.ndarray:
    return np.frombuffer(memoryview(buf).cast("B"), np.uint8)


def contribution(stripes: Stripes, i: int, b: int, data) -> list[tuple[int, int, int, np.ndarray]]:
    """Member ``i``'s block ``b`` (``data``, ``span(i, b)`` long) -> its share of each parity
    block of its stripe: (holder, stripe, row, share) for rows 0..m-1. A share is as long as the
    block, rounded up to even (the rest of its parity block it leaves unchanged)."""
    if not 0 <= i < stripes.n or not 0 <= b < stripes.k:
        raise ValueError(f"no block {b!r} of member {i!r} in a {stripes.k}+{stripes.m} group")
    raw = _as_bytes(data)
    if raw.size != stripes.span(i, b)[1]:
        raise ValueError(f"block {b} of member {i} is {stripes.span(i, b)[1]} bytes, got {raw.size}")
    if raw.size & 1:
        raw = np.concatenate([raw, np.zeros(1, np.uint8)])
    code, s = _Code.of(stripes.k, stripes.m), stripes.stripe_of(i, b)
    shares = _multiply([code.table(j, b) for j in range(stripes.m)], raw.view(np.uint16))
    return [(h, s, j, shares[j].view(np.uint8)) for j, h in enumerate(stripes.holders(s))]


_CHUNK = 1 << 17  # words per table look-up: the index buffer and the outputs' pieces stay in cache


def _multiply(tables: list[np.ndarray], words: np.ndarray) -> list[np.ndarray]:
    """``words`` through each table. Chunked, with one index buffer converted once for all the
    tables: numpy converts uint16 indices to intp anyway, and measured ~1.8x faster this way."""
    outs = [np.empty_like(words) for _ in tables]
    idx = np.empty(min(_CHUNK, words.size), np.intp)
    for start in range(0, words.size, _CHUNK):
        n = min(_CHUNK, words.size - start)
        idx[:n] = words[start : start + n]
        for table, out in zip(tables, outs, strict=True):
            np.take(table, idx[:n], out=out[start : start + n])
    return outs


def fold(parity: np.ndarray, share) -> None:
    """XOR ``share`` into the start of ``parity`` (a ``block``-long uint8 buffer), in place."""
    raw = _as_bytes(share)
    if parity.dtype != np.uint8 or raw.size > parity.size:
        raise ValueError(f"a share of {raw.size} bytes does not fold into a parity block of {parity.size}")
    np.bitwise_xor(parity[: raw.size], raw, out=parity[: raw.size])


def plan(stripes: Stripes, lost: Iterable[int]) -> dict[int, list[tuple[int, int]]]:
    """Stripe -> the (member, zfec block number) to read to rebuild the parts of ``lost``: only
    the stripes where a lost member gave data, ``k`` surviving blocks each, data before parity
    (block numbers < k are data slots, k+j parity row j). ValueError if a stripe lost more than
    ``m`` (nothing can rebuild it) or ``lost`` names no member."""
    gone = set(lost)
    if not gone <= set(range(stripes.n)):
        raise ValueError(f"lost members must be among 0..{stripes.n - 1}, got {sorted(gone)!r}")
    if len(gone) > stripes.m:
        raise ValueError(
            f"{len(gone)} members lost in a {stripes.k}+{stripes.m} group: at most {stripes.m} can be rebuilt"
        )
    reads: dict[int, list[tuple[int, int]]] = {}
    for s in sorted({stripes.stripe_of(i, b) for i in gone for b in range(stripes.k)}):
        data = [(c, t) for t, c in enumerate(stripes.contributors(s)) if c not in gone]
        parity = [(h, stripes.k + j) for j, h in enumerate(stripes.holders(s)) if h not in gone]
        reads[s] = (data + parity)[: stripes.k]
    return reads


def recover(stripes: Stripes, lost: Iterable[int], read: Callable[[int, int, int], object]) -> dict[int, bytearray]:
    """The parts of the ``lost`` members, rebuilt from survivors' blocks: ``read(member, stripe,
    number)`` returns that member's block (data: ``span`` long, padding implied; parity:
    ``length(s)`` long) and is called only for the blocks ``plan`` names. ValueError if a block read
    has the wrong length, or as ``plan``."""
    gone = sorted(set(lost))
    reads = plan(stripes, gone)
    code = _Code.of(stripes.k, stripes.m)
    parts = {i: bytearray(stripes.sizes[i]) for i in gone}
    for s, wanted in reads.items():
        size, blocks = stripes.length(s), []
        for member, num in wanted:
            raw = _as_bytes(read(member, s, num))
            want = stripes.span(member, num)[1] if num < stripes.k else size
            if raw.size != want:
                raise ValueError(f"block {num} of stripe {s} from member {member} is {raw.size} bytes, not {want}")
            if raw.size < size:
                raw = np.concatenate([raw, np.zeros(size - raw.size, np.uint8)])
            blocks.append(raw)
        if len(blocks) < stripes.k:  # plan refuses this; kept as a guard for a changed plan
            raise ValueError(f"stripe {s} has {len(blocks)} surviving blocks, needs {stripes.k}")
        decoded = code.decoder.decode(blocks, [num for _, num in wanted]) if size else [b""] * stripes.k
        for t, c in enumerate(stripes.contributors(s)):
            if c in parts:
                start, length = stripes.span(c, t)
                parts[c][start : start + length] = memoryview(decoded[t])[:length]
    return parts
