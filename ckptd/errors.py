"""Errors raised by ckptd. Every message names the checkpoint, the key and what differs."""

from __future__ import annotations

__all__ = [
    "AlreadyCommitted",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CorruptChunkError",
    "SaveAborted",
    "StateMismatchError",
    "StepClaimed",
    "StepHeld",
]


class CheckpointError(Exception):
    """A checkpoint could not be saved, found, read or applied.

    Raised instead of a storage or torch exception so that callers catch one type; the message
    is a single line meant for a human (the CLI prints it as is).
    """


class CheckpointNotFoundError(CheckpointError):
    """The asked-for checkpoint does not exist, or is partial (never committed)."""


class CorruptChunkError(CheckpointError):
    """A chunk failed its crc32c check, or a shard is truncated or malformed."""


class StateMismatchError(CheckpointError):
    """The state being restored into does not match the checkpoint (keys, shapes, dtypes)."""


# -- the save protocol's refusals (ckptd.claims, ckptd.commit, ckptd.persist) ----------------------


class AlreadyCommitted(CheckpointError):
    """The step already has ``commit.json``: a committed checkpoint is immutable."""


class StepClaimed(CheckpointError):
    """Another writer (job) is writing this step: two writers on one root are refused."""


class StepHeld(StepClaimed):
    """Another job's live claim (its lease is being renewed, or has not run out yet) holds this
    step. That job may still commit it; a trainer hook skips the step once and saves the next
    (``Checkpointer.save``)."""


class SaveAborted(CheckpointError):
    """The save's deadline passed; what was not yet durable is not made so."""
