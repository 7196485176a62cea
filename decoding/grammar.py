"""Structured outputs under speculation: one grammar matcher per request, and the token masks a
speculative block needs (llguidance underneath; docs/structured-outputs.md says why not xgrammar).

Why a mask per block position: in a round, draft row i and target row i both score the token that
follows history + d_1..d_i. Masking BOTH rows with the grammar's allowed set after exactly that
prefix means rejection sampling compares two distributions over the same allowed set, so what it
emits follows the target's masked distribution exactly (the ordinary losslessness argument, with
p and q replaced by their masked, renormalised rows). A draft token the grammar forbids has
target mass zero after masking and is always rejected; the rows after it are never used.

The matcher only ever holds committed tokens: `block_masks` walks the draft tokens forward and
rolls them back, and `commit` consumes what verification emitted.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import llguidance
import llguidance.hf
import numpy as np
import torch

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]

# Any JSON object: what OpenAI's {"type": "json_object"} promises.
JSON_OBJECT_SCHEMA = {"type": "object"}


class StructuredOutputError(ValueError):
    """A grammar, schema or regex that cannot be compiled; `param` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to, in canonical text (hashable: the compile cache key).

    kind: json_schema (source: the schema as JSON), json_object, regex, choice (source: a JSON list
    of strings), grammar (source: a Lark grammar, llguidance's dialect). param: the request field
    it came from, named in errors."""

    kind: GrammarKind
    source: str = ""
    param: str = "structured_outputs"

    @classmethod
    def json_schema(cls, schema: Any, param: str) -> "GrammarSpec":
        if not isinstance(schema, dict):
            raise StructuredOutputError(f"{param} must be a JSON schema object", param)
        return cls("json_schema", json.dumps(schema, sort_keys=True), param)

    @classmethod
    def choice(cls, choices: Sequence[str], param: str) -> "GrammarSpec":
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise StructuredOutputError(f"{param} must be a non-empty list of non-empty strings", param)
        return cls("choice", json.dumps(list(choices)), param)

    def llguidance_grammar(self) -> str:
        """The grammar in llguidance's serialized form."""
        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.source)
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(JSON_OBJECT_SCHEMA)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            alternatives = " | ".join(json.dumps(choice) for choice in json.loads(self.source))
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        return llguidance.LLMatcher.grammar_from_lark(self.source)


class GrammarCompiler:
    """Compiles GrammarSpecs against one tokenizer, with a cache: the same spec is validated once.

    Building the tokenizer's byte-level view is the expensive part (done once here); a matcher
    per request is then cheap. vocab_size is the model's row width, which may exceed the
    tokenizer's (padded embeddings): ids past the tokenizer are never allowed."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, eos_token=list(eos_token_ids) or None)
        self._validated = functools.lru_cache(maxsize=256)(self._validate)

    def _validate(self, spec: GrammarSpec) -> str:
        try:
            grammar = spec.llguidance_grammar()
        except ValueError as exc:
            raise StructuredOutputError(f"{spec.param}: {exc}", spec.param) from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise StructuredOutputError(f"{spec.param}: {messages[0] if messages else 'invalid grammar'}", spec.param)
        return grammar

    def matcher(self, spec: GrammarSpec) -> "GrammarMatcher":
        """A fresh matcher for one request; StructuredOutputError if the spec does not compile."""
        return GrammarMatcher(llguidance.LLMatcher(self.tokenizer, self._validated(spec), log_level=0),
                              self.vocab_size, self.eos_token_ids)


class GrammarMatcher:
    """One request's grammar state over its committed output tokens."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and admits nothing more (only EOS is allowed now)."""
        return self._matcher.is_stopped()

    def allowed(self) -> torch.Tensor:
        """BoolTensor [V]: the tokens the grammar allows next."""
        bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
        width = min(self.vocab_size, bits.size)
        allowed[:width] = torch.from_numpy(bits[:width].astype(bool))
        return allowed

    def block_masks(self, draft_token_ids: Sequence[int]) -> torch.Tensor:
        """BoolTensor [K+1, V]: row i allows what may follow the committed tokens + d_1..d_i.

        Row i masks draft row i (which proposes d_{i+1}) and target row i. The walk stops at a
        forbidden d_i (rejected for certain) or at EOS (the request ends there if it is taken):
        later rows are never read, and repeat the last mask so every row stays a proper
        distribution. EOS is not walked through: the matcher does not count it as a token, so it
        could not be rolled back."""
        masks = [self.allowed()]
        consumed = 0
        for token in draft_token_ids:
            if not masks[-1][token] or int(token) in self.eos_token_ids or not self._matcher.consume_token(int(token)):
                break
            consumed += 1
            masks.append(self.allowed())
        if consumed and not self._matcher.rollback(consumed):
            raise RuntimeError(f"grammar matcher could not roll back {consumed} draft tokens")
        masks.extend(masks[-1:] * (len(draft_token_ids) + 1 - len(masks)))
        return torch.stack(masks)

    def commit(self, token_ids: Sequence[int]) -> None:
        """Advance through tokens verification emitted (each was allowed by its mask)."""
        if token_ids and not self._matcher.consume_tokens([int(t) for t in token_ids]):
            raise RuntimeError(f"grammar refused committed tokens {list(token_ids)}: "
                               f"{self._matcher.get_error()}")


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits [n, V] with every token a mask row forbids set to -inf (before temperature, top-k,
    top-p: the mask decides the support, the sampling parameters shape it, as in vLLM)."""
    return logits.masked_fill(~allowed[:, : logits.shape[-1]], float("-inf"))
