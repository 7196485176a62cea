"""Structured outputs under speculation: one grammar matcher per request, and the token masks a
speculative block needs (llguidance underneath; docs/structured-outputs.md says why not xgrammar).

Why a mask per block position: in a round, draft row i and target row i both score the token that
follows history + d_1..d_i. Masking BOTH rows with the grammar's allowed set after exactly that
prefix means rejection sampling compares two distributions over the same allowed set, so what it
emits follows the target's masked distribution exactly (the ordinary losslessness argument, with
p and q replaced by their masked, renormalised rows). A draft token the grammar forbids has
target mass zero after masking and is always rejected; the rows after it are never used.

An engine keeps one matcher per sequence (`GrammarMatchers`) and brings it to each call's
history (`GrammarMatcher.sync`): the common prefix with what it consumed stays, the rest is rolled
back and the new tokens are consumed. So after verification the matcher advances through the
accepted and the recovered/bonus token and rolls back the rejected draft tokens, paying for
new tokens only; a re-prefilled or diverged history needs no special case.
"""

from __future__ import annotations

import functools
import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

if TYPE_CHECKING:
    import llguidance


def _llguidance():
    """llguidance, imported on first use: only structured outputs need it, and the core (decoding/)
    must import where it is not installed (the GPU check's machine, docs/testing.md)."""
    import llguidance
    import llguidance.gbnf_to_lark
    import llguidance.hf

    return llguidance


GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]

# Any JSON object: what OpenAI's {"type": "json_object"} promises.
JSON_OBJECT_SCHEMA = {"type": "object"}


class StructuredOutputError(ValueError):
    """A grammar, schema or regex that cannot be compiled; `param` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class GrammarDeadEndError(RuntimeError):
    """The grammar allows no token at all after the output so far (nothing can be generated).
    Raised on an engine and carried by Ray to the ingress, which answers 400 naming `param`."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # pickled across processes: keep param (the default pickles args only)
        return type(self), (str(self), self.param)


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to, in canonical text (hashable: the compile cache key).

    kind: json_schema (source: the schema as JSON), json_object, regex, choice (source: a JSON list
    of strings), grammar (source: a Lark grammar, llguidance's dialect). param: the request field
    it came from, named in errors.

    JSON kinds are compact by default (no whitespace between tokens): with free whitespace a small
    model, masked to JSON, puts much of its mass on newlines and spends max_tokens on them
    (docs/structured-outputs.md), so the default must be one users get valid output from. Free
    whitespace is opt-in: whitespace_flexible (or a schema's own "x-guidance"), or a pattern."""

    kind: GrammarKind
    source: str = ""
    param: str = "structured_outputs"
    whitespace_flexible: bool = False  # JSON kinds: any whitespace between tokens (vLLM's default; opt-in here)
    whitespace_pattern: str | None = None

    @classmethod
    def json_schema(cls, schema: Any, param: str, **options: Any) -> "GrammarSpec":
        """The schema's key order is kept: it is the order the properties are generated in."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise StructuredOutputError(f"{param} is not valid JSON: {exc}", param) from None
        if not isinstance(schema, dict):
            raise StructuredOutputError(f"{param} must be a JSON schema object", param)
        return cls("json_schema", json.dumps(schema), param, **options)

    @classmethod
    def choice(cls, choices: Sequence[str], param: str) -> "GrammarSpec":
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise StructuredOutputError(f"{param} must be a non-empty list of non-empty strings", param)
        return cls("choice", json.dumps(list(choices)), param)

    def llguidance_grammar(self) -> str:
        """The grammar in llguidance's serialized form (ValueError if it cannot even be translated)."""
        llguidance = _llguidance()
        if self.kind in ("json_schema", "json_object"):
            options: dict[str, Any] = {"whitespace_flexible": self.whitespace_flexible}
            if self.whitespace_pattern is not None:
                options["whitespace_pattern"] = self.whitespace_pattern
            schema = self.source if self.kind == "json_schema" else JSON_OBJECT_SCHEMA
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            alternatives = " | ".join(json.dumps(choice) for choice in json.loads(self.source))
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        # Lark (llguidance's dialect) or GBNF/EBNF as llama.cpp and xgrammar write it (`root ::= ...`).
        return llguidance.LLMatcher.grammar_from_lark(llguidance.gbnf_to_lark.any_to_lark(self.source))


class GrammarCompiler:
    """Compiles GrammarSpecs against one tokenizer, with a cache: the same spec is validated once.

    Building the tokenizer's byte-level view is the expensive part (done once here); a matcher
    per request is then cheap. vocab_size is the model's row width, which may exceed the
    tokenizer's (padded embeddings): ids past the tokenizer are never allowed."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.tokenizer = _llguidance().hf.from_tokenizer(hf_tokenizer, eos_token=list(eos_token_ids) or None)
        self._validated = functools.lru_cache(maxsize=256)(self._validate)
        self._initial = functools.lru_cache(maxsize=256)(self._build_initial)

    def validate(self, spec: GrammarSpec) -> str:
        """The compiled grammar, or StructuredOutputError (naming spec.param) if the spec does not
        compile; cached per spec (the same spec gets the same compiled grammar). The ingress calls
        it in a worker thread so that compiling never blocks its event loop."""
        return self._validated(spec)

    def _validate(self, spec: GrammarSpec) -> str:
        try:
            grammar = spec.llguidance_grammar()
        except Exception as exc:  # the GBNF translator raises more than ValueError
            raise StructuredOutputError(f"{spec.param}: {exc}", spec.param) from None
        is_error, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise StructuredOutputError(f"{spec.param}: {messages[0] if messages else 'invalid grammar'}", spec.param)
        return grammar

    def matcher(self, spec: GrammarSpec) -> "GrammarMatcher":
        """A fresh matcher for one request; StructuredOutputError if the spec does not compile."""
        return GrammarMatcher(self._initial(spec).deep_copy(), self.vocab_size, self.eos_token_ids, spec)

    def _build_initial(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """A matcher in its initial state, kept per spec: copying it costs a microsecond, building
        one from the grammar text about a millisecond (every new request, on both engines)."""
        return _llguidance().LLMatcher(self.tokenizer, self._validated(spec), log_level=0)


@functools.lru_cache(maxsize=4)
def compiler_for(tokenizer_path: str, vocab_size: int, eos_token_ids: tuple[int, ...]) -> GrammarCompiler:
    """The process's compiler for one served tokenizer (loaded once, on the first request with a
    grammar: requests without one never pay for it)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    return GrammarCompiler(tokenizer, vocab_size, eos_token_ids)


class GrammarMatcher:
    """One request's grammar state over its committed output tokens."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_token_ids: frozenset[int],
                 spec: GrammarSpec | None = None) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.spec = spec
        self.consumed: list[int] = []  # the tokens the matcher holds, in order

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
        for token in draft_token_ids:
            if not self.step(token, masks[-1]):
                break
            masks.append(self.allowed())
        self.rollback(len(masks) - 1)
        masks.extend(masks[-1:] * (len(draft_token_ids) + 1 - len(masks)))
        return torch.stack(masks)

    def step(self, token: int, allowed: torch.Tensor | None = None) -> bool:
        """Consume one token if the grammar takes it now (allowed: the current mask, if at hand);
        False, and nothing consumed, for a forbidden token or EOS (which the matcher would not
        count as a token, so it could not be rolled back)."""
        token = int(token)
        if token in self.eos_token_ids or (allowed is not None and not allowed[token]):
            return False
        if self._matcher.try_consume_tokens([token]) != 1:
            return False
        self.consumed.append(token)
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise RuntimeError(f"grammar matcher could not roll back {num_tokens} tokens")
        del self.consumed[len(self.consumed) - num_tokens:]

    def commit(self, token_ids: Sequence[int]) -> None:
        """Advance through tokens verification emitted (each was allowed by its mask)."""
        if self.sync(self.consumed + [int(t) for t in token_ids]) != len(self.consumed):
            raise RuntimeError(f"grammar refused committed tokens {list(token_ids)}: "
                               f"{self._matcher.get_error()}")

    def sync(self, output_ids: Sequence[int]) -> int:
        """Bring the matcher to output_ids (a request's output so far): keep the common prefix with
        what it holds, roll back the rest, consume the new tokens. Returns how many of output_ids
        it now holds: fewer than all when one is refused or is EOS (it stops there)."""
        common = 0
        for held, token in zip(self.consumed, output_ids):
            if held != token:
                break
            common += 1
        self.rollback(len(self.consumed) - common)
        new = [int(t) for t in output_ids[common:]]
        if new:
            eos = next((i for i, t in enumerate(new) if t in self.eos_token_ids), len(new))
            taken = self._matcher.try_consume_tokens(new[:eos]) if eos else 0
            self.consumed += new[:taken]
        return len(self.consumed)

    def check_alive(self, masks: torch.Tensor) -> None:
        """GrammarDeadEndError if a mask row allows nothing: no token could be generated there."""
        if not bool(masks.any(dim=-1).all()):
            param = self.spec.param if self.spec is not None else "structured_outputs"
            raise GrammarDeadEndError(f"{param}: the grammar allows no token of this model's vocabulary after "
                                      f"{len(self.consumed)} output tokens; nothing can be generated", param)


class GrammarMatchers:
    """One engine's matchers, one per sequence, synced to each call's output (see the module
    docstring). Least recently used ones are dropped past max_sequences; `release` drops one."""

    def __init__(self, compiler: GrammarCompiler | Callable[[], GrammarCompiler], max_sequences: int = 4096) -> None:
        self._compiler = compiler
        self._matchers: OrderedDict[str, GrammarMatcher] = OrderedDict()
        self.max_sequences = max_sequences

    @classmethod
    def for_runner(cls, runner: Any, tokenizer_path: str) -> "GrammarMatchers":
        """An engine's matchers over its runner's served ids and EOS set; the tokenizer is loaded
        on the first structured request (compiler_for)."""
        return cls(lambda: compiler_for(tokenizer_path, runner.vocab_size, tuple(sorted(runner.eos_token_ids))))

    @property
    def compiler(self) -> GrammarCompiler:
        if not isinstance(self._compiler, GrammarCompiler):
            self._compiler = self._compiler()
        return self._compiler

    def synced(self, seq_id: str, spec: GrammarSpec, output_ids: Sequence[int]) -> GrammarMatcher | None:
        """seq_id's matcher holding exactly output_ids, or None when the grammar refuses them (a
        speculative history, e.g. a block drafted ahead past EOS)."""
        matcher = self._matchers.get(seq_id)
        if matcher is None or matcher.spec != spec:
            matcher = self.compiler.matcher(spec)
        self._matchers[seq_id] = matcher
        self._matchers.move_to_end(seq_id)
        while len(self._matchers) > self.max_sequences:
            self._matchers.popitem(last=False)
        return matcher if matcher.sync(output_ids) == len(output_ids) else None

    def release(self, seq_id: str) -> None:
        self._matchers.pop(seq_id, None)


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits [n, V] with every token a mask row forbids set to -inf (before temperature, top-k,
    top-p: the mask decides the support, the sampling parameters shape it, as in vLLM)."""
    return logits.masked_fill(~allowed[:, : logits.shape[-1]], float("-inf"))
