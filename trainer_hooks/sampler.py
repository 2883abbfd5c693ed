"""Elastic, resumable sampling for synchronous data-parallel training.

`ElasticSampler` deals one epoch's sample indices to the ranks of a job and keeps, as its whole
state, the *global* position of the epoch. Saved at world size N and loaded at world size M, the
epoch continues where it stopped and every index is yielded once across the job.
`StatefulLoader` wraps a `DataLoader` with worker processes, whose prefetching pulls indices from
the sampler ahead of training, so that the position counts what training has actually received.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, Sampler

from ckptd.sampler_math import STATE_KEYS, STATE_VERSION, position_after, share

__all__ = ["ElasticSampler", "StatefulLoader"]


@dataclass
class _Pass:
    """One pass over the rest of an epoch on this rank.

    A new pass starts at each `iter()` of the sampler; its position becomes the sampler's state.
    """

    start: int  # global position of the epoch where the pass began
    consumed: int = 0  # indices of this pass consumed on this rank
    finished: bool = False  # this rank ran the pass to its end
    counted_by_loader: bool = False  # a StatefulLoader, not the sampler, counts `consumed`


def _check_int(name: str, value: Any, minimum: int) -> int:
    # bool is an int subclass; True as a dataset length or an epoch is a bug, not a value
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class ElasticSampler(Sampler[int]):
    """Sampler for one data-parallel rank whose state loads at any world size.

    **Global order.** Epoch `e` visits a permutation of `range(dataset_len)`: `torch.randperm`
    drawn from a generator seeded with `seed + e` when `shuffle`, else `0, 1, ..., len - 1`. The
    order depends on the seed and the epoch only, never on the world size or the rank.

    **Dealing.** The state is the global position `P` of the epoch: the first `P` indices of the
    order have been consumed by the job. With world size `W` the rest is dealt round-robin, as
    `DistributedSampler` interleaves: rank `r` yields `order[P + r]`, `order[P + r + W]`, ... So
    once every rank has consumed `k` indices the job has consumed exactly `order[:P + k*W]`, and
    the position is `P + k*W` (capped at `dataset_len`) on every rank alike.

    **State.** `state_dict()` holds ints and bools only (checkpoints store it as JSON): `epoch`,
    `position`, `seed`, `shuffle`, `drop_last`, `dataset_len` and a format `version`. Nothing in
    it depends on the rank or the world size, so the state of any rank loads on any rank of a job
    of any size. It is the same on every rank as long as the ranks consume in lockstep, as
    synchronous data-parallel training does. `load_state_dict()` refuses a state whose
    `dataset_len`, `seed` or `shuffle` differ from this sampler's (`ValueError` naming both
    values); `drop_last` stays this sampler's own, which changes which tail is dropped but never
    yields an index twice.

    **What counts as consumed.** By default an index counts as consumed when this sampler's
    iterator hands it out. That is exact for a loop over the sampler and for a
    `DataLoader(num_workers=0)`, which pulls indices only when a batch is asked for. A
    `DataLoader` with workers pulls up to `prefetch_factor * num_workers` batches of indices
    ahead of training: iterate `StatefulLoader(loader)` instead, which counts the batches it
    has delivered to the training loop and makes the position say exactly that.

    **Passes and epochs.** Each `iter()` starts a pass at the current position and yields the
    rest of the epoch for this rank. Leaving a pass early (`break`) keeps its position: the next
    pass or a restart continues there. A pass that ran to its end leaves the position at
    `dataset_len` -- the epoch is done, and a job restored from that state iterates nothing
    until it moves on -- and the next pass of this sampler starts the same epoch again at 0 (as
    `DistributedSampler` repeats the epoch when `set_epoch` is never called). `set_epoch(e)`
    with a new `e` resets the position to 0; with the current epoch it changes nothing, so::

        hook.resume()                                   # loads the sampler's state
        for epoch in range(sampler.epoch, num_epochs):
            sampler.set_epoch(epoch)                    # same epoch: keeps the position
            for batch in loader: ...

    **The tail of the epoch.** With `drop_last=False` nothing is padded: padding would repeat
    indices and break the exactly-once guarantee. In the last round some ranks get one index
    fewer, so `len()` is `ceil` of the rest over `W` on the lower ranks and `floor` on the
    others, the last batches may differ in size across ranks, and with a batch size that divides
    the smaller share a rank may even get one batch fewer. Training must tolerate uneven inputs
    at the end of an epoch (for example `torch.distributed.algorithms.Join` for DDP); take
    `drop_last=True` when it cannot. With `drop_last=True` every rank yields
    `floor((dataset_len - P) / W)` indices and the last `< W` indices of the order are not
    yielded this epoch; which ones depends on the world sizes the epoch ran at. No index is ever
    yielded twice. Pair it with `DataLoader(drop_last=True)` for equal batch counts and sizes;
    that also skips each rank's last partial batch for the epoch (fewer than `W * batch_size`
    indices in all), still never yielding one twice.

    **Concurrency.** Not thread-safe: construct, iterate, `set_epoch`, `state_dict` and
    `load_state_dict` from the training thread. Every rank makes the same calls in the same
    order; none of them communicates.
    """

    def __init__(
        self,
        dataset_len: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        rank: int | None = None,
        num_replicas: int | None = None,
    ) -> None:
        super().__init__()
        initialised = dist.is_available() and dist.is_initialized()
        if num_replicas is None:
            num_replicas = dist.get_world_size() if initialised else 1
        if rank is None:
            rank = dist.get_rank() if initialised else 0
        self._dataset_len = _check_int("dataset_len", dataset_len, 0)
        self._seed = _check_int("seed", seed, -(2**63))
        self._num_replicas = _check_int("num_replicas", num_replicas, 1)
        self._rank = _check_int("rank", rank, 0)
        if self._rank >= self._num_replicas:
            raise ValueError(f"rank must be < num_replicas={self._num_replicas}, got {self._rank}")
        self._shuffle = bool(shuffle)
        self._drop_last = bool(drop_last)
        self._epoch = 0
        self._pass = _Pass(start=0)
        # a pass begun by StatefulLoader, adopted by the next __iter__ (the DataLoader's)
        self._pending: _Pass | None = None

    # -- read-only views -------------------------------------------------------------------

    @property
    def dataset_len(self) -> int:
        return self._dataset_len

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def num_replicas(self) -> int:
        return self._num_replicas

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def position(self) -> int:
        """Global position in the current epoch: indices of its order consumed by the job."""
        return self._position_of(self._pass)

    # -- the Sampler protocol --------------------------------------------------------------

    def __iter__(self) -> Iterator[int]:
        # Computed eagerly: the pass starts where the position is when iter() is called.
        pass_ = self._pending if self._pending is not None else self._new_pass(counted_by_loader=False)
        self._pending = None
        count = self._share(pass_.start)
        first = pass_.start + self._rank
        indices = self._order()[first : first + count * self._num_replicas : self._num_replicas].tolist()
        return self._yield(pass_, indices)

    def __len__(self) -> int:
        """Indices this rank yields in a pass begun now (the rest of the epoch for this rank)."""
        return self._share(self._next_start())

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch to sample; a different epoch than the current starts at position 0."""
        epoch = _check_int("epoch", epoch, 0)
        if epoch != self._epoch:
            self._epoch = epoch
            self._pass = _Pass(start=0)
            self._pending = None

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int | bool]:
        return {
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "position": self.position,
            "seed": self._seed,
            "shuffle": self._shuffle,
            "drop_last": self._drop_last,
            "dataset_len": self._dataset_len,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restores epoch and position; the next `iter()` continues there at this world size."""
        missing = [key for key in STATE_KEYS if key not in state_dict]
        if missing:
            raise ValueError(f"ElasticSampler state lacks {', '.join(missing)}: got keys {sorted(state_dict)}")
        version = state_dict["version"]
        if version != STATE_VERSION:
            raise ValueError(f"ElasticSampler state has version {version!r}, this code reads {STATE_VERSION}")
        for key, mine in (
            ("dataset_len", self._dataset_len),
            ("seed", self._seed),
            ("shuffle", self._shuffle),
        ):
            saved = state_dict[key]
            # type() too: JSON keeps True and 1 apart, and so do we
            if type(saved) is not type(mine) or saved != mine:
                raise ValueError(
                    f"ElasticSampler state has {key}={saved!r}, this sampler has {key}={mine!r}; "
                    "the saved position means nothing in another sample order"
                )
        epoch = _check_int("saved epoch", state_dict["epoch"], 0)
        position = _check_int("saved position", state_dict["position"], 0)
        if position > self._dataset_len:
            raise ValueError(f"saved position {position} is past dataset_len={self._dataset_len}")
        self._epoch = epoch
        self._pass = _Pass(start=position)
        self._pending = None

    # -- internals -------------------------------------------------------------------------

    def _order(self) -> torch.Tensor:
        if not self._shuffle:
            return torch.arange(self._dataset_len)
        generator = torch.Generator()
        generator.manual_seed(self._seed + self._epoch)
        return torch.randperm(self._dataset_len, generator=generator)

    def _share(self, start: int) -> int:
        """Indices this rank gets of order[start:]."""
        return share(self._dataset_len, start, self._rank, self._num_replicas, self._drop_last)

    def _position_of(self, pass_: _Pass) -> int:
        if pass_.finished:
            return self._dataset_len
        return position_after(self._dataset_len, pass_.start, pass_.consumed, self._num_replicas, self._drop_last)

    def _next_start(self) -> int:
        return 0 if self._pass.finished else self._position_of(self._pass)

    def _new_pass(self, counted_by_loader: bool) -> _Pass:
        self._pass = _Pass(start=self._next_start(), counted_by_loader=counted_by_loader)
        return self._pass

    @staticmethod
    def _yield(pass_: _Pass, indices: list[int]) -> Iterator[int]:
        # Counted when handed out: the consumer has it from then on.
        for index in indices:
            if not pass_.counted_by_loader:
                pass_.consumed += 1
            yield index
        if not pass_.counted_by_loader:
            pass_.finished = True


class StatefulLoader:
    """Iterates a `DataLoader` and advances its `ElasticSampler` by the batches training received.

    A `DataLoader` with `num_workers > 0` pulls indices from its sampler up to
    `prefetch_factor * num_workers` batches ahead of the training loop, so the sampler's own
    count runs ahead of what was trained on, and a checkpoint taken then would skip those
    samples on restore. Iterate this wrapper instead of the loader: each batch it hands to the
    training loop advances the sampler by the loader's batch size (1 without auto-batching), and
    a loop that runs to its end finishes the epoch. The sampler's `state_dict()` then says
    exactly which indices training has received, with any number of workers. Batch sizes are
    the same on every rank, so the count stays the same on every rank in lockstep.

    The loader must be built with `sampler=ElasticSampler(...)` (with `batch_size`, or
    `batch_size=None`), or with `batch_sampler=torch.utils.data.BatchSampler(ElasticSampler(...),
    ...)`; other batch samplers make batch sizes unknowable and are refused. One iteration at a
    time: start the next after leaving the previous one.
    """

    def __init__(self, loader: DataLoader) -> None:
        batch_sampler = loader.batch_sampler
        if isinstance(loader.sampler, ElasticSampler):
            sampler = loader.sampler
            per_step = loader.batch_size if loader.batch_size is not None else 1
        elif type(batch_sampler) is BatchSampler and isinstance(batch_sampler.sampler, ElasticSampler):
            sampler = batch_sampler.sampler
            per_step = batch_sampler.batch_size
        else:
            raise TypeError(
                "StatefulLoader needs a DataLoader built with sampler=ElasticSampler(...) or "
                f"batch_sampler=BatchSampler(ElasticSampler(...), ...); got sampler "
                f"{type(loader.sampler).__name__} and batch_sampler {type(batch_sampler).__name__}"
            )
        self._loader = loader
        self._sampler = sampler
        self._per_step = per_step

    @property
    def loader(self) -> DataLoader:
        return self._loader

    @property
    def sampler(self) -> ElasticSampler:
        return self._sampler

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self) -> Iterator[Any]:
        sampler = self._sampler
        pass_ = sampler._new_pass(counted_by_loader=True)
        sampler._pending = pass_  # the DataLoader's iter(sampler) adopts it
        try:
            for batch in self._loader:
                pass_.consumed += self._per_step
                yield batch
            pass_.finished = True
        finally:
            if sampler._pending is pass_:
                sampler._pending = None
