"""The errors an engine's calls raise, in one module every other imports (and that imports none of
them), so the runner, the block manager, the scheduler and tensor parallelism each depend on it
one way rather than on each other."""

from __future__ import annotations


class SequenceStateError(RuntimeError):
    """A sequence id the engine cannot serve (e.g. too long for the model's context)."""


class NoFreeSlotError(SequenceStateError):
    """A new sequence arrived while the engine already holds max_sequences of them: release
    finished sequences, or let the request wait for a slot."""


class NoFreeBlocksError(NoFreeSlotError):
    """The KV budget has no free blocks for this batch's new tokens: the call must wait until
    other sequences finish (the engine queues it, then answers "overloaded" past its deadline)."""
