"""Incremental detokenization: each committed token costs O(1) decoding, not a re-decode of the
whole output (which made streaming and stop-string checks quadratic in output length).

The scheme is the prefix-offset / read-offset one serving engines use (vLLM's
`detokenize_incrementally`, the `tokenizers` DecodeStream): decode only a short window of recent
tokens, `ids[prefix:]`, and emit what it adds to the already-emitted part of that window,
`ids[prefix:read]`. A window whose text ends in U+FFFD may end inside a multi-byte character, so it
is held until a later token completes the character (or the request ends: `flush`). The window
keeps the tokens of the last emission as left context, so a tokenizer whose decoding of a token
depends on its neighbour (leading-space handling) decodes it as the whole output would. For
byte-level BPE (the default pair) the emitted pieces concatenate exactly to `decode(ids)`.
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT_CHAR = "\ufffd"  # what a detokenizer prints for an incomplete UTF-8 sequence
# Tokens that decode to nothing (skipped special tokens, e.g. EOS under ignore_eos) stay in the
# window as context only up to this many, so a run of them cannot make the window grow without bound.
MAX_CONTEXT_TOKENS = 8


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text pieces, one decode of a short window per token."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.prefix_offset = 0   # window start: tokens before it are never decoded again
        self.read_offset = 0     # tokens before it have been turned into emitted text
        self.num_stepped = 0     # tokens seen by step
        self.prefix_text = ""    # decode(ids[prefix_offset:read_offset])
        self.held_text = ""      # what the last step decoded but held back (ends with U+FFFD)

    def step(self, token_ids: list[int]) -> str:
        """Text completed by the tokens not yet seen ("" while a character is incomplete).

        Tokens are taken one at a time, so the result does not depend on how commits were batched."""
        pieces = []
        while self.num_stepped < len(token_ids):
            self.num_stepped += 1
            window_text = self.decode(token_ids[self.prefix_offset:self.num_stepped])
            if window_text.endswith(REPLACEMENT_CHAR):  # maybe the first bytes of a character: wait
                self.held_text = window_text[len(self.prefix_text):]
            else:
                self.held_text = ""
                pieces.append(self._advance(token_ids, window_text))
        return "".join(pieces)

    def flush(self, token_ids: list[int]) -> str:
        """Everything not yet emitted, an incomplete trailing character included (as U+FFFD)."""
        text = self.step(token_ids)
        if self.read_offset < len(token_ids):
            text += self._advance(token_ids, self.decode(token_ids[self.prefix_offset:]))
        self.held_text = ""
        return text

    def _advance(self, token_ids: list[int], window_text: str) -> str:
        """Emit what window_text (the decoded window up to num_stepped) adds to prefix_text."""
        new_text = window_text[len(self.prefix_text):] if len(window_text) > len(self.prefix_text) else ""
        if new_text:  # the tokens just emitted become the next window's left context
            self.prefix_offset = self.read_offset
        elif self.num_stepped - self.prefix_offset > MAX_CONTEXT_TOKENS:
            self.prefix_offset = self.num_stepped - MAX_CONTEXT_TOKENS
        self.read_offset = self.num_stepped
        # Decoded on its own, not sliced out of window_text: the decoding of a window's first token
        # may differ from its decoding in context, and the next window starts with it too.
        self.prefix_text = self.decode(token_ids[self.prefix_offset:self.read_offset])
        return new_text
