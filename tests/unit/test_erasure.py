"""The erasure-coded layout of the memory tier (``ckptd.server.erasure``): the layout's balance,
the linearity the encoding rests on (checked against the library's own encoder), every loss of
at most m members rebuilt bitwise, more refused before anything is read, and hostile sizes."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import zfec

from ckptd.server.erasure import MAX_GROUP, MAX_PART_BYTES, Stripes, contribution, fold, parse_ec, plan, recover

CODES = [(4, 2), (2, 1)]


def _group(k: int, m: int, sizes: list[int], seed: int = 0):
    """Stripes, every member's part and every parity block, encoded share by share (``fold``)."""
    st = Stripes(tuple(f"http://node{i}:7000" for i in range(k + m)), k, m, tuple(sizes))
    rng = np.random.default_rng(seed)
    parts = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for size in sizes]
    parity = {(s, j): np.zeros(st.block, np.uint8) for s in range(st.n) for j in range(m)}
    for i, part in enumerate(parts):
        for b in range(k):
            start, length = st.span(i, b)
            for holder, s, j, share in contribution(st, i, b, part[start : start + length]):
                assert holder == st.holders(s)[j]
                fold(parity[(s, j)], share)
    return st, parts, parity


def _reader(st: Stripes, parts, parity, log: list):
    def read(member: int, s: int, num: int):
        log.append((member, s, num))
        if num >= st.k:
            assert st.holders(s)[num - st.k] == member
            return parity[(s, num - st.k)].tobytes()
        assert st.contributors(s)[num] == member
        start, length = st.span(member, num)
        return parts[member][start : start + length]

    return read


@pytest.mark.parametrize("k,m", CODES)
def test_each_member_gives_k_blocks_and_holds_m_parity_blocks(k, m):
    st = Stripes(tuple("abcdef"[: k + m]), k, m, (1000,) * (k + m))
    for s in range(st.n):
        assert len(set(st.holders(s) + st.contributors(s))) == st.n  # nobody twice in a stripe
    for i in range(st.n):
        assert sorted(st.stripe_of(i, b) for b in range(k)) == sorted(s for s in range(st.n) if i in st.contributors(s))
        assert all(st.contributors(st.stripe_of(i, b))[b] == i for b in range(k))
        assert sorted(st.parity_of(i)) == sorted(
            (s, j) for s in range(st.n) for j, h in enumerate(st.holders(s)) if h == i
        )


@pytest.mark.parametrize("k,m", CODES + [(1, 1), (3, 3)])
def test_shares_xored_equal_the_librarys_parity(k, m):
    """Linearity: the XOR of every slot's share is zfec's parity of the stripe, and each share is
    zfec's encoding of that block in its slot with zero blocks elsewhere."""
    rng = np.random.default_rng(k * 10 + m)
    block = (1 << 18) + 6  # bytes: the look-ups of a share cross a chunk's end (erasure._CHUNK words)
    st = Stripes(tuple(range(k + m)), k, m, (block * k,) * (k + m))
    assert st.block == block
    s = 0
    data = [rng.integers(0, 256, block, dtype=np.uint8).tobytes() for _ in range(k)]
    encoder = zfec.Encoder(k, k + m)
    want = encoder.encode(data, list(range(k, k + m)))
    got = [np.zeros(block, np.uint8) for _ in range(m)]
    for t, member in enumerate(st.contributors(s)):
        assert st.stripe_of(member, t) == s
        for _, _, j, share in contribution(st, member, t, data[t]):
            alone = [bytes(block)] * k
            alone[t] = data[t]
            assert share.tobytes() == encoder.encode(alone, [k + j])[0]
            fold(got[j], share)
    assert [g.tobytes() for g in got] == list(want)


@pytest.mark.parametrize("k,m", CODES)
@pytest.mark.parametrize("seed", range(3))
def test_every_loss_of_at_most_m_members_is_rebuilt_bitwise(k, m, seed):
    rng = np.random.default_rng(seed)
    # random lengths: an empty part, odd lengths, lengths not a multiple of k, one much larger
    sizes = [0, 1, int(rng.integers(1, 5000)), int(rng.integers(1, 5000)) * k + 1, 7, 12345][: k + m]
    rng.shuffle(sizes)
    st, parts, parity = _group(k, m, [int(x) for x in sizes], seed)
    for count in range(1, m + 1):
        for lost in itertools.combinations(range(st.n), count):
            log: list = []
            got = recover(st, lost, _reader(st, parts, parity, log))
            assert sorted(got) == list(lost)
            for i in lost:
                assert bytes(got[i]) == parts[i], f"member {i} of lost {lost}"
            assert not any(member in lost for member, _, _ in log)
            # only the stripes where a lost member gave data, k blocks each
            touched = {st.stripe_of(i, b) for i in lost for b in range(k)}
            assert {s for _, s, _ in log} == touched
            assert len(log) == k * len(touched)


def test_recover_reads_surviving_data_before_parity():
    st, parts, parity = _group(4, 2, [4000] * 6)
    log: list = []
    recover(st, [0], _reader(st, parts, parity, log))
    # one block lost per stripe: three surviving data blocks and one parity block each
    assert sorted(num >= st.k for _, _, num in log) == [False] * 12 + [True] * 4


@pytest.mark.parametrize("k,m", CODES)
def test_more_than_m_losses_are_refused_before_any_read(k, m):
    st, parts, parity = _group(k, m, [100] * (k + m))
    log: list = []
    for lost in itertools.combinations(range(st.n), m + 1):
        with pytest.raises(ValueError, match=f"at most {m} can be rebuilt"):
            recover(st, lost, _reader(st, parts, parity, log))
    assert log == []
    with pytest.raises(ValueError, match="lost members must be among"):
        plan(st, [st.n])


@pytest.mark.parametrize("k,m", CODES)
def test_memory_held_per_member_is_1_plus_m_over_k_of_the_padded_part(k, m):
    size = 6 << 20  # a multiple of 2k: no padding
    st = Stripes(tuple(range(k + m)), k, m, (size,) * (k + m))
    assert all(st.held(i) == size * (k + m) // k for i in range(st.n))
    uneven = Stripes(tuple(range(k + m)), k, m, (size, 10) + (size - 1,) * (k + m - 2))
    assert uneven.block == size // k  # padded to the largest part
    assert [uneven.held(i) for i in range(st.n)] == [s + m * size // k for s in uneven.sizes]


def test_an_empty_group_encodes_and_recovers_nothing():
    st, parts, parity = _group(2, 1, [0, 0, 0])
    assert st.block == 0
    assert recover(st, [1], _reader(st, parts, parity, [])) == {1: bytearray()}


@pytest.mark.parametrize("spec", ["4", "4+", "+2", "0+2", "4+0", "a+b", "-1+2", "30+3", "4+2+1", " "])
def test_bad_codes_are_refused(spec):
    with pytest.raises(ValueError, match="--ec must be|an erasure code needs"):
        parse_ec(spec)


def test_good_codes_parse():
    assert parse_ec("4+2") == (4, 2)
    assert parse_ec(f"{MAX_GROUP - 1}+1") == (MAX_GROUP - 1, 1)


@pytest.mark.parametrize(
    "members,sizes,match",
    [
        (("a", "b"), (1, 1, 1), "has 3 distinct members"),
        (("a", "a", "b"), (1, 1, 1), "has 3 distinct members"),
        (("a", "b", "c"), (1, 1), "needs 3 part sizes"),
        (("a", "b", "c"), (1, -1, 1), "part size of 'b'"),
        (("a", "b", "c"), (1, MAX_PART_BYTES + 1, 1), "part size of 'b'"),
        (("a", "b", "c"), (1, 1.5, 1), "part size of 'b'"),
        (("a", "b", "c"), (1, True, 1), "part size of 'b'"),
    ],
)
def test_hostile_layouts_are_refused(members, sizes, match):
    with pytest.raises(ValueError, match=match):
        Stripes(members, 2, 1, sizes)


def test_blocks_of_the_wrong_length_are_refused():
    st, parts, parity = _group(2, 1, [100, 100, 100])
    with pytest.raises(ValueError, match="is 50 bytes, got 49"):
        contribution(st, 0, 0, parts[0][:49])
    with pytest.raises(ValueError, match="no block 2 of member 0"):
        contribution(st, 0, 2, parts[0][:50])
    with pytest.raises(ValueError, match="does not fold"):
        fold(np.zeros(10, np.uint8), bytes(11))

    def short(member, s, num):
        return bytes(3)

    with pytest.raises(ValueError, match="bytes, not 50"):
        recover(st, [0], short)


@pytest.mark.parametrize("k,m", CODES)
def test_parts_cut_by_their_own_size_are_rebuilt_from_parity_grown_share_by_share(k, m):
    """``per_member`` (the daemon's layout): each member codes its part knowing only its own
    size, each holder's parity grows to its longest share (what ``fold`` into a longer buffer
    keeps); any m losses rebuild bitwise, the short parity read padded with zeros."""
    sizes = [5000, 37, 0, 4999, 12, 3001][: k + m]
    members = tuple(f"http://node{i}:7000" for i in range(k + m))
    rng = np.random.default_rng(3)
    parts = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    parity: dict = {}
    for i, part in enumerate(parts):
        own = Stripes(members, k, m, tuple(n if j == i else 0 for j, n in enumerate(sizes)), per_member=True)
        for b in range(k):
            start, length = own.span(i, b)
            for _, s, j, share in contribution(own, i, b, part[start : start + length]):
                old = parity.get((s, j), np.zeros(0, np.uint8))
                grown = np.zeros(max(old.size, share.size), np.uint8)
                grown[: old.size] = old
                fold(grown, share)
                parity[(s, j)] = grown
    st = Stripes(members, k, m, tuple(sizes), per_member=True)
    assert all(p.size <= st.length(s) for (s, _), p in parity.items())

    def read(member: int, s: int, num: int):
        if num >= k:
            p = parity.get((s, num - k), np.zeros(0, np.uint8))
            return np.concatenate([p, np.zeros(st.length(s) - p.size, np.uint8)])
        start, length = st.span(member, num)
        return parts[member][start : start + length]

    for lost in itertools.combinations(range(k + m), m):
        got = recover(st, lost, read)
        assert all(bytes(got[i]) == parts[i] for i in lost), lost
    assert st.held(0) < sizes[0] + m * max(sizes)  # not padded to the largest part
