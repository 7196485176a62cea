"""Structured outputs through the real speculative path: the draft proposer with its grammar masks,
the target's `target_rows` and `accept_round`, each side with its own per-sequence matchers, as the
engines hold them. Sampled output follows the target's masked distribution exactly (a broken mask
is caught); greedy output equals HF `generate` with the same llguidance mask as a logits processor.

The equalities asserted here hold on CPU in float32, where the tests run; on a GPU in bf16 greedy
output may differ at near-ties and with what shares a batch (docs/gpu.md)."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch
from scipy import stats
from transformers import AutoTokenizer, LogitsProcessor, LogitsProcessorList

from specserve.decoding.generate import generate, generate_batch
from specserve.decoding.grammar import GrammarCompiler, GrammarDeadEndError, GrammarMatcher, GrammarMatchers, GrammarSpec
from specserve.decoding.block_manager import ForwardCall
from specserve.decoding.batched_runner import BatchedModelRunner
from specserve.decoding.scheduler import Scheduler
from specserve.decoding.proposers import DraftModelProposer, ProposeCall
from specserve.decoding.row_processors import GrammarMask, history_processor
from specserve.decoding.sampling import SamplingParams
from specserve.decoding.sequence import RequestState
from specserve.decoding.speculation import target_rows
from tests.tiny_pair import TOKENIZER_DIR, make_tiny_pair

K = 3
MAX_TOKENS = 4
NUM_SAMPLES = 3000        # the full run (marker stat_full, `make stat-full`)
NUM_CHECK_SAMPLES = 1000  # the CI-sized run, the broken variant and the unmasked-draft sanity check
P_VALUE_FLOOR = 1e-3
TV_BOUND = 0.06         # the 30 outputs with mass: expected empirical TV about 0.035 at 3000 samples
CHECK_TV_BOUND = 0.1    # about 0.06 at 1000 samples
BROKEN_TV_FLOOR = 0.15  # the broken variant lands far beyond both bounds
PROMPT = [5, 6, 7]
REGEX = "(a|b)+c"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def _ids(tokenizer, *texts):
    return [tokenizer.encode(text, add_special_tokens=False)[0] for text in texts]


class TableModel:
    """A model whose logits depend only on the output so far: seeded random logits on a few real
    tokens (a, b, c, EOS), -inf elsewhere, over the first `vocab_size` ids. A runner for the
    real proposer (forward_batch, max_context, release) and cheap enough for thousands of rounds."""

    max_context = 64
    device = torch.device("cpu")

    def __init__(self, seed: int, support: list[int], vocab_size: int) -> None:
        self.seed, self.support, self.vocab_size = seed, support, vocab_size
        self._rows: dict[tuple[int, ...], torch.Tensor] = {}

    def logits(self, output: tuple[int, ...]) -> torch.Tensor:
        if output not in self._rows:
            generator = torch.Generator().manual_seed(hash((self.seed, output)) & 0xFFFFFFFF)
            row = torch.full((self.vocab_size,), float("-inf"))
            row[self.support] = 1.5 * torch.randn(len(self.support), generator=generator)
            self._rows[output] = row
        return self._rows[output]

    def forward_batch(self, calls: list[ForwardCall]) -> list[torch.Tensor]:
        return [torch.stack([self.logits(tuple(call.token_ids[len(PROMPT):len(call.token_ids) - call.num_rows + 1 + i]))
                             for i in range(call.num_rows)]) for call in calls]

    def release(self, seq_id: str) -> None:
        pass


class CommittedStateMatcher(GrammarMatcher):
    """Broken on purpose: every row of a block masked with the committed state's mask, as if the
    block's draft tokens were not walked through."""

    def block_masks(self, draft_token_ids):
        return self.allowed().expand(len(draft_token_ids) + 1, -1).clone()


class BrokenCompiler(GrammarCompiler):
    def matcher(self, spec):
        good = super().matcher(spec)
        return CommittedStateMatcher(good._matcher, good.vocab_size, good.eos_token_ids, spec)


def _setup(tokenizer):
    support = _ids(tokenizer, "a", "b", "c") + [tokenizer.eos_token_id]
    vocab_size = max(support) + 1  # ids past the model's width are never allowed
    compiler = GrammarCompiler(tokenizer, vocab_size, [tokenizer.eos_token_id])
    return support, vocab_size, compiler


def _exact(target: TableModel, compiler: GrammarCompiler, spec: GrammarSpec, eos: int) -> dict[tuple, float]:
    """P(output) under the masked target, enumerated (EOS ends an output and is kept as its last id)."""
    exact: dict[tuple, float] = {}

    def walk(output: tuple[int, ...], probability: float) -> None:
        if len(output) == MAX_TOKENS:
            exact[output] = exact.get(output, 0.0) + probability
            return
        matcher = compiler.matcher(spec)
        matcher.commit(list(output))
        logits = target.logits(output).masked_fill(~matcher.allowed()[:target.vocab_size], float("-inf"))
        probs = torch.softmax(logits.double(), dim=-1)
        for token in torch.nonzero(probs).flatten().tolist():
            if token == eos:
                exact[output + (eos,)] = exact.get(output + (eos,), 0.0) + probability * float(probs[token])
            else:
                walk(output + (token,), probability * float(probs[token]))

    walk((), 1.0)
    return exact


def _speculative_samples(draft: TableModel, target: TableModel, draft_grammars: GrammarMatchers | None,
                         target_grammars: GrammarMatchers, spec: GrammarSpec, eos: int,
                         num_samples: int = NUM_SAMPLES) -> dict[tuple, int]:
    """num_samples seeded requests decoded to the end by speculative rounds of depth K, all through
    the real path (the prefill's first token is a round with no draft block, as on the router).
    An output the grammar refuses (only a broken mask makes one) ends with "error": marked "refused"."""
    params = [SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=i, structured=spec) for i in range(num_samples)]
    states = [RequestState(f"s{i}", PROMPT, params[i], eos, max_context=64) for i in range(num_samples)]
    generate_batch(target, states, DraftModelProposer(draft, draft_grammars), K, "block", target_grammars)
    counts: dict[tuple, int] = {}
    for state in states:
        output = tuple(state.output_ids) + {"stop": (eos,), "error": ("refused",)}.get(state.finish_reason, ())
        counts[output] = counts.get(output, 0) + 1
    return counts


def _verdict(counts: dict[tuple, int], exact: dict[tuple, float]) -> tuple[float, float]:
    """(chi-square p-value, cells of expected count < 5 and unexpected outputs pooled; total variation)."""
    num_samples = sum(counts.values())
    unexpected = sum(n for output, n in counts.items() if output not in exact)
    big = [output for output, p in exact.items() if p * num_samples >= 5]
    small = [output for output in exact if output not in big]
    observed = [counts.get(o, 0) for o in big] + [sum(counts.get(o, 0) for o in small) + unexpected]
    wanted = [exact[o] * num_samples for o in big] + [sum(exact[o] for o in small) * num_samples + 1e-9]
    p_value = stats.chisquare(observed, np.array(wanted) * sum(observed) / sum(wanted)).pvalue
    tv = 0.5 * (sum(abs(counts.get(o, 0) / num_samples - p) for o, p in exact.items()) + unexpected / num_samples)
    return p_value, tv


@pytest.mark.parametrize("num_samples, tv_bound", [
    (NUM_CHECK_SAMPLES, CHECK_TV_BOUND), pytest.param(NUM_SAMPLES, TV_BOUND, marks=pytest.mark.stat_full)])
def test_sampled_speculation_follows_the_masked_target_and_a_wrong_mask_is_caught(tokenizer, num_samples, tv_bound):
    """CI runs 1,000 samples (TV under 0.1); stat_full 3,000 (TV under 0.06). The broken variant
    is caught at 1,000 samples in both."""
    support, vocab_size, compiler = _setup(tokenizer)
    spec = GrammarSpec("regex", REGEX)
    eos = tokenizer.eos_token_id
    target, draft = TableModel(1, support, vocab_size), TableModel(2, support, vocab_size)
    exact = _exact(target, compiler, spec, eos)
    assert abs(sum(exact.values()) - 1.0) < 1e-9 and len(exact) == 30

    counts = _speculative_samples(draft, target, GrammarMatchers(compiler), GrammarMatchers(compiler), spec, eos,
                                  num_samples)
    p_value, tv = _verdict(counts, exact)
    assert p_value > P_VALUE_FLOOR and tv < tv_bound, (p_value, tv)

    # Broken: the target's rows all masked with the committed state's mask (the block's draft tokens
    # not walked through). Output leaves the grammar's language and its distribution.
    broken = GrammarMatchers(BrokenCompiler(tokenizer, vocab_size, [eos]))
    counts = _speculative_samples(draft, target, GrammarMatchers(compiler), broken, spec, eos, NUM_CHECK_SAMPLES)
    p_value, tv = _verdict(counts, exact)
    assert p_value < 1e-6 and tv > BROKEN_TV_FLOOR, (p_value, tv)


def test_an_unmasked_draft_is_still_lossless_and_a_masked_one_never_proposes_forbidden_tokens(tokenizer):
    """Masking only the target is enough for losslessness (rejection sampling makes any draft
    follow p); the draft's mask only saves rejected tokens. Fewer samples: a sanity check."""
    support, vocab_size, compiler = _setup(tokenizer)
    spec, eos = GrammarSpec("regex", REGEX), tokenizer.eos_token_id
    target, draft = TableModel(1, support, vocab_size), TableModel(2, support, vocab_size)
    counts = _speculative_samples(draft, target, None, GrammarMatchers(compiler), spec, eos, NUM_CHECK_SAMPLES)
    p_value, tv = _verdict(counts, _exact(target, compiler, spec, eos))
    assert p_value > P_VALUE_FLOOR and tv < CHECK_TV_BOUND, (p_value, tv)

    proposer = DraftModelProposer(draft, GrammarMatchers(compiler))
    for seed in range(50):
        params = SamplingParams(temperature=1.0, max_tokens=8, seed=seed, structured=spec)
        proposal = proposer.propose_batch([ProposeCall("d", PROMPT, 3, params, torch.Generator().manual_seed(seed),
                                                       len(PROMPT))])[0]
        matcher = compiler.matcher(spec)
        assert matcher.sync(proposal.token_ids) == len(proposal.token_ids) or eos in proposal.token_ids


def test_a_row_the_grammar_leaves_empty_raises_a_clear_error(tokenizer):
    """A grammar whose every token lies past the model's width (here: a width of 50 ids) can
    produce nothing: the error names the request field instead of sampling from NaN."""
    compiler = GrammarCompiler(tokenizer, 50, [tokenizer.eos_token_id])
    spec = GrammarSpec("regex", "zzz", "structured_outputs.regex")
    params = SamplingParams(temperature=1.0, structured=spec)
    with pytest.raises(GrammarDeadEndError, match="structured_outputs.regex") as info:
        target_rows(torch.randn(1, 50), params, tokenizer.eos_token_id, 0, PROMPT, compiler.matcher(spec))
    carried = pickle.loads(pickle.dumps(info.value))  # as Ray carries it from the engine to the ingress
    assert (str(carried), carried.param) == (str(info.value), "structured_outputs.regex")


def test_min_tokens_yields_to_a_finished_grammar(tokenizer):
    """Once the grammar is complete only EOS is allowed: min_tokens cannot mask it away."""
    _, vocab_size, compiler = _setup(tokenizer)
    spec = GrammarSpec.choice(["a"], "structured_outputs.choice")
    matcher = compiler.matcher(spec)
    matcher.commit(_ids(tokenizer, "a"))
    params = SamplingParams(temperature=0, min_tokens=5, structured=spec)
    ids = target_rows(torch.randn(1, vocab_size), params, tokenizer.eos_token_id, 1, PROMPT + _ids(tokenizer, "a"),
                      matcher)
    assert ids.tolist() == [tokenizer.eos_token_id]


def test_draft_steps_and_a_verify_block_are_masked_alike(tokenizer):
    """GrammarMask stepping through a block one token at a time (the drafter) gives the rows a
    verify over the whole block gives (the target), and the engine's next sync rolls the drafted
    tokens back."""
    _, vocab_size, compiler = _setup(tokenizer)
    a, b, c = _ids(tokenizer, "a", "b", "c")
    matchers = GrammarMatchers(compiler)
    block = [a, b, c, a]  # c completes the grammar; the a after it is refused
    logits = torch.randn(len(block) + 1, vocab_size)
    whole = GrammarMask(matchers.synced("x", GrammarSpec("regex", REGEX), [])).process(logits, block)
    stepping = history_processor(SamplingParams(structured=GrammarSpec("regex", REGEX)), PROMPT, len(PROMPT), vocab_size,
                                 grammar=matchers.synced("x", GrammarSpec("regex", REGEX), []))
    for i in range(len(block) + 1):
        assert torch.equal(stepping.process(logits[i:i + 1])[0], whole[i])
        if i < len(block):
            stepping.advance([block[i]])
    assert matchers.synced("x", GrammarSpec("regex", REGEX), [a]).consumed == [a]


# --- greedy: equal to HF generate with the same mask ------------------------------------------------

class LLGuidanceProcessor(LogitsProcessor):
    """HF logits processor: the llguidance mask of the output so far (a fresh matcher per step)."""

    def __init__(self, compiler: GrammarCompiler, spec: GrammarSpec, prompt_len: int) -> None:
        self.compiler, self.spec, self.prompt_len = compiler, spec, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        matcher = self.compiler.matcher(self.spec)
        matcher.commit(input_ids[0, self.prompt_len:].tolist())
        return scores.masked_fill(~matcher.allowed()[: scores.shape[-1]], float("-inf"))


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    target_path, draft_path = make_tiny_pair(tmp_path_factory.mktemp("structured-pair"))
    return Scheduler(BatchedModelRunner(str(target_path))), Scheduler(BatchedModelRunner(str(draft_path)))


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}


@pytest.mark.parametrize("spec", [GrammarSpec.json_schema(SCHEMA, "response_format", whitespace_flexible=False),
                                  GrammarSpec.choice(["red", "green", "blue"], "structured_outputs.choice")],
                         ids=["json_schema", "choice"])
def test_greedy_constrained_output_equals_hf_generate_with_the_same_mask(tokenizer, tiny_pair, spec):
    target, draft = tiny_pair
    compiler = GrammarCompiler(tokenizer, target.vocab_size, sorted(target.eos_token_ids))
    eos = sorted(target.eos_token_ids)
    for prompt_text in ("Answer: ", "def f(x):"):
        prompt = tokenizer.encode(prompt_text)
        with torch.no_grad():
            hf = target.runner.model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, pad_token_id=0,
                                       logits_processor=LogitsProcessorList([LLGuidanceProcessor(compiler, spec,
                                                                                                 len(prompt))]))
        expected = hf[0, len(prompt):].tolist()
        expected = expected[:min((expected.index(t) for t in eos if t in expected), default=len(expected))]
        for proposer in (None, DraftModelProposer(draft, GrammarMatchers(compiler))):
            state = RequestState("g", prompt, SamplingParams(temperature=0, max_tokens=30, structured=spec), eos,
                                 target.max_context)
            for _ in generate(target, state, proposer, num_draft_tokens=4, grammars=GrammarMatchers(compiler)):
                pass
            assert state.output_ids == expected, (proposer, tokenizer.decode(state.output_ids))
        if spec.kind == "json_schema" and len(expected) < 30:
            assert set(json.loads(tokenizer.decode(expected))) == {"name", "ok"}


def test_the_ingress_finds_a_dead_end_inside_rays_wrappers():
    """Engine -> router -> ingress: Ray wraps the error at each hop; the ingress answers 400 with
    the innermost error's message and field."""
    from ray.exceptions import RayTaskError

    from specserve.deployments.ingress import _cause

    inner = GrammarDeadEndError("structured_outputs.regex: nothing allowed", "structured_outputs.regex")
    wrapped = RayTaskError("generate", "", RayTaskError("verify", "", inner).as_instanceof_cause()).as_instanceof_cause()
    found = _cause(wrapped, GrammarDeadEndError)
    assert (str(found), found.param) == (str(inner), inner.param)
    assert _cause(RayTaskError("verify", "", ValueError("x")).as_instanceof_cause(), GrammarDeadEndError) is None


# --- the default: what a user gets from the shipped pair ---------------------------------------------

TICKET_SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["bug", "feature", "question"]},
                                                  "urgent": {"type": "boolean"},
                                                  "votes": {"type": "integer", "minimum": 0, "maximum": 1000}},
                 "required": ["kind", "urgent", "votes"], "additionalProperties": False}
TICKET_PROMPTS = ["ticket = ", "# the issue as JSON\nissue = ", "def to_dict(self):\n    return "]


@pytest.fixture(scope="module")
def default_pair():
    from specserve.common.config import DEFAULT_MODELS_DIR
    return tuple(Scheduler(BatchedModelRunner(str(DEFAULT_MODELS_DIR / role), max_sequences=16))
                 for role in ("target", "draft"))


def test_json_schema_requests_to_the_default_pair_parse_and_validate_at_ordinary_max_tokens(tokenizer, default_pair):
    """response_format json_schema as a user sends it, no whitespace option: greedy and sampled
    outputs of the shipped pair, speculation on, all end with EOS within 96 tokens and validate.
    (With free whitespace, the default before, every one ran to max_tokens on newlines.)"""
    import jsonschema

    from specserve.deployments.openai_protocol import CompletionRequest

    target, draft = default_pair
    eos = sorted(target.eos_token_ids)
    compiler = GrammarCompiler(tokenizer, target.vocab_size, eos)
    states = []
    for index in range(12):
        request = CompletionRequest.model_validate({
            "model": "m", "prompt": TICKET_PROMPTS[index % len(TICKET_PROMPTS)], "max_tokens": 96,
            "response_format": {"type": "json_schema", "json_schema": {"name": "ticket", "schema": TICKET_SCHEMA}}})
        greedy = index < len(TICKET_PROMPTS)
        params = SamplingParams(temperature=0 if greedy else 1.0, max_tokens=request.requested_max_tokens,
                                seed=None if greedy else index, structured=request.structured_spec())
        states.append(RequestState(f"t{index}", tokenizer.encode(request.prompt), params, eos, target.max_context))
    generate_batch(target, states, DraftModelProposer(draft, GrammarMatchers(compiler)), 4,
                   grammars=GrammarMatchers(compiler))
    for state in states:
        text = tokenizer.decode(state.output_ids)
        assert state.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), TICKET_SCHEMA)
