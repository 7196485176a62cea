"""Engines keep each request's committed history, so a round sends what changed, not the context.

The router owns a request's committed history (prompt + committed output; it only grows). For
each engine a request uses it keeps a `HistorySender`: how many committed tokens it has told that
engine, so each call carries only the tokens committed since (common.messages.HistoryUpdate),
plus a digest of the whole committed history. The engine keeps the history it was told in
`CommittedHistories` and checks every update against the digest; when it cannot rebuild the
history (it never saw the request, forgot it, or the digest disagrees) it answers
`UnknownHistory` and the router sends the whole history once. An engine thus never computes on a
history the router does not hold, and a lost, restarted or replaced engine costs one full send.

The digest is a polynomial hash of the token ids modulo the Mersenne prime 2^61 - 1, extended
token by token, so both ends update it in O(new tokens) a round and it does not depend on how the
history was split into updates. It guards against protocol slips (a lost or reordered update), not
against an adversary: engines only ever hold what the router sent them.
"""

from __future__ import annotations

from collections.abc import Sequence

from specserve.common.messages import HistoryUpdate
from specserve.decoding.sequence import RequestState

DIGEST_MODULUS = (1 << 61) - 1
DIGEST_BASE = 1_000_003  # any base in [2, modulus) works; a large odd one spreads small ids


def history_digest(token_ids: Sequence[int], digest: int = 0) -> int:
    """The digest of (the history digest was of) + token_ids."""
    for token in token_ids:
        digest = (digest * DIGEST_BASE + int(token) + 1) % DIGEST_MODULUS
    return digest


class RunningDigest:
    """The digest of a request's committed history, kept up to date as it grows (router side)."""

    def __init__(self) -> None:
        self.length = 0
        self.digest = 0

    def of(self, state: RequestState) -> int:
        """state's committed history's digest; the history must extend the one last seen."""
        length = len(state.prompt_ids) + len(state.output_ids)
        if length < self.length:
            raise ValueError("a committed history never shrinks")
        self.digest = history_digest(committed_tail(state, self.length), self.digest)
        self.length = length
        return self.digest


class HistorySender:
    """What one engine has been told of one request's committed history (router side)."""

    def __init__(self, digest: RunningDigest) -> None:
        self.digest = digest
        self.sent = 0  # committed tokens this engine was told (0: none, or it lost them)

    def update(self, state: RequestState) -> HistoryUpdate:
        """The update for the next call to this engine, which is then counted as told: if the
        call never arrives, the engine's next answer is UnknownHistory and `forget` resets."""
        update = HistoryUpdate(self.sent, tuple(committed_tail(state, self.sent)), self.digest.of(state),
                               state.cache_salt if self.sent == 0 else None)
        self.sent = update.length
        return update

    def forget(self) -> None:
        """The engine does not hold the history (it said so, or it is a new engine): next time, all of it."""
        self.sent = 0


def whole_history(token_ids: Sequence[int], cache_salt: str | None = None) -> HistoryUpdate:
    """A committed history sent whole, as to an engine that never saw the request (tests and
    in-process benchmarks call engines without a router's HistorySender)."""
    return HistoryUpdate(0, tuple(token_ids), history_digest(token_ids), cache_salt)


def committed_tail(state: RequestState, start: int) -> list[int]:
    """state's committed history from token `start` on, without copying the rest of it."""
    num_prompt = len(state.prompt_ids)
    if start >= num_prompt:
        return state.output_ids[start - num_prompt:]
    return state.prompt_ids[start:] + state.output_ids


class CommittedHistories:
    """Each sequence's committed history as this engine was told it (engine side)."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[list[int], int]] = {}  # seq_id -> (tokens, their digest)

    def apply(self, seq_id: str, update: HistoryUpdate) -> list[int] | None:
        """The sequence's committed history after update (the engine's own list: copy it before
        appending to it), or None when the update cannot be applied here; then nothing is kept
        for seq_id and the caller answers UnknownHistory."""
        tokens, digest = self._held.pop(seq_id, ([], 0))
        if update.start > len(tokens):  # told tokens this engine never got, or has forgotten
            return None
        if update.start == len(tokens):  # the usual round: the tokens committed since the last one
            tokens.extend(update.new_tokens)
            digest = history_digest(update.new_tokens, digest)
        else:  # the sender counts fewer than held (a whole history re-sent): rebuild from its count
            tokens = tokens[:update.start] + list(update.new_tokens)
            digest = history_digest(tokens)
        if digest != update.digest:
            return None
        self._held[seq_id] = (tokens, digest)
        return tokens

    def extend(self, seq_id: str, new_tokens: Sequence[int]) -> list[int] | None:
        """The sequence's committed history grown by new_tokens that this engine drew itself and
        counts as committed (a target-only round the router queued to continue the one before),
        or None when it holds none."""
        held = self._held.get(seq_id)
        if held is None:
            return None
        tokens, digest = held
        tokens.extend(new_tokens)
        self._held[seq_id] = (tokens, history_digest(new_tokens, digest))
        return tokens

    def held_length(self, seq_id: str) -> int:
        held = self._held.get(seq_id)
        return 0 if held is None else len(held[0])

    def forget(self, seq_id: str) -> None:
        self._held.pop(seq_id, None)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._held
