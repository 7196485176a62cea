"""Structured outputs under speculation (decoding/grammar.py): per-position block masks from the
real llguidance matcher, and rejection sampling over masked rows following the target's masked
distribution exactly — with a check that the same test rejects masks taken from the wrong state."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from scipy import stats
from transformers import AutoTokenizer

from specserve.decoding.grammar import GrammarCompiler, GrammarSpec, StructuredOutputError, mask_logits
from specserve.decoding.rejection import PLACEHOLDER_TOKEN_ID, rejection_sample
from tests.test_generate import null_tv_bound
from tests.tiny_pair import TOKENIZER_DIR

K = 3
SAMPLES = 120_000


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def _ids(tokenizer, *texts):
    ids = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    assert all(len(i) == 1 for i in ids), ids
    return [i[0] for i in ids]


def test_block_masks_follow_the_draft_and_leave_the_matcher_where_it_was(tokenizer, compiler):
    a, b, c = _ids(tokenizer, "a", "b", "c")
    matcher = compiler.matcher(GrammarSpec("regex", "(ab)+c"))
    masks = matcher.block_masks([a, b, a])
    assert masks.shape == (4, len(tokenizer))
    assert masks[0, a] and not masks[0, b] and not masks[0, c]     # must start with a
    assert masks[1, b] and not masks[1, a]                          # after a: b
    assert masks[2, a] and masks[2, c]                              # after ab: another a, or c
    assert masks[3, b] and not masks[3, c]
    assert torch.equal(matcher.allowed(), masks[0])                 # the draft was rolled back
    matcher.commit([a, b])
    assert torch.equal(matcher.allowed(), masks[2])
    matcher.commit([c])
    assert matcher.is_finished
    allowed = matcher.allowed()
    assert allowed[tokenizer.eos_token_id] and allowed.sum() == 1


def test_a_forbidden_draft_token_stops_the_walk_and_later_rows_stay_valid(tokenizer, compiler):
    a, b = _ids(tokenizer, "a", "b")
    matcher = compiler.matcher(GrammarSpec("regex", "(ab)+c"))
    masks = matcher.block_masks([b, a, a])  # b is forbidden first
    assert not masks[0, b] and all(torch.equal(masks[i], masks[0]) for i in range(4))
    assert torch.equal(matcher.allowed(), masks[0])


@pytest.mark.parametrize("spec, param", [
    (GrammarSpec("regex", "(a|b", "structured_outputs.regex"), "structured_outputs.regex"),
    (GrammarSpec("grammar", "start: (", "structured_outputs.grammar"), "structured_outputs.grammar"),
    (GrammarSpec("json_schema", json.dumps({"type": "frobnicate"}), "response_format.json_schema.schema"),
     "response_format.json_schema.schema"),
])
def test_invalid_grammars_name_their_field(compiler, spec, param):
    with pytest.raises(StructuredOutputError) as info:
        compiler.matcher(spec)
    assert info.value.param == param and param in str(info.value)


def test_compilation_is_cached_per_spec(compiler):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    first = compiler.validate(GrammarSpec.json_schema(schema, "response_format"))
    assert compiler.validate(GrammarSpec.json_schema(dict(schema), "response_format")) is first


def test_choice_and_json_schema_walks_only_produce_valid_output(tokenizer, compiler):
    """Random walks through the allowed sets (uniform over allowed tokens, whitespace-only tokens
    avoided so JSON walks end) always end in text the grammar describes: the masks are the
    grammar's, whatever the model."""
    generator = torch.Generator().manual_seed(0)
    blank = torch.tensor([not tokenizer.decode([i]).strip() for i in range(len(tokenizer))])
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
              "required": ["color", "ok"], "additionalProperties": False}
    for spec, check in [(GrammarSpec.choice(["yes", "no", "maybe"], "structured_outputs.choice"),
                         lambda text: text in ("yes", "no", "maybe")),
                        (GrammarSpec.json_schema(schema, "response_format"),
                         lambda text: set(json.loads(text)) == {"color", "ok"} and json.loads(text)["color"] in ("red", "green"))]:
        for _ in range(20):
            matcher, tokens = compiler.matcher(spec), []
            while not matcher.is_finished and len(tokens) < 200:
                allowed = matcher.allowed()
                if (allowed & ~blank).any():
                    allowed &= ~blank
                token = int(torch.multinomial(allowed.float(), 1, generator=generator))
                matcher.commit([token])
                tokens.append(token)
            assert matcher.is_finished, tokenizer.decode(tokens)
            assert check(tokenizer.decode(tokens)), tokenizer.decode(tokens)


# --- the statistical test ----------------------------------------------------------------------
# A prefix-dependent toy model pair over five real tokens (a, b, ab, c, EOS) under the grammar
# (a|b)+c: every prefix has its own random target and draft rows. Masks come from the real
# matcher (`block_masks`, through every prefix of depth <= K); sampling runs batched on the
# five-token support so 120k speculative rounds take seconds.

def _support(tokenizer):
    return _ids(tokenizer, "a", "b", "ab", "c") + [tokenizer.eos_token_id]


def _mask_table(tokenizer, compiler, support, wrong_state: bool = False) -> dict[tuple[int, ...], torch.Tensor]:
    """prefix (support indices) -> allowed support tokens after it, from one block walk per prefix.
    wrong_state: the broken variant, every position masked with the committed state's mask."""
    table = {}
    for depth in range(K + 1):
        for prefix in itertools.product(range(len(support)), repeat=depth):
            matcher = compiler.matcher(GrammarSpec("regex", "(a|b)+c"))
            masks = matcher.block_masks([support[i] for i in prefix])
            row = masks[0 if wrong_state else depth]
            table[prefix] = row[support]
    return table


def _rows(seed: int, support_size: int) -> dict[tuple[int, ...], torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {prefix: torch.randn(support_size, generator=generator) * 1.5
            for depth in range(K + 2) for prefix in itertools.product(range(support_size), repeat=depth)}


def _masked_probs(logits, allowed):
    return torch.softmax(mask_logits(logits.unsqueeze(0), allowed.unsqueeze(0))[0], dim=-1)


def _exact(table, target_logits, support_size):
    """P(first K+1 tokens = seq) under the masked target, for every sequence with mass."""
    exact = {}
    for seq in itertools.product(range(support_size), repeat=K + 1):
        probability = 1.0
        for depth in range(K + 1):
            prefix = seq[:depth]
            allowed = table.get(prefix)
            if allowed is None or not allowed[seq[depth]]:
                probability = 0.0
                break
            probability *= float(_masked_probs(target_logits[prefix], allowed)[seq[depth]])
        if probability > 0:
            exact[seq] = probability
    return exact


def _speculative_samples(table, target_logits, draft_logits, support_size, seed):
    """SAMPLES rounds from the empty prefix: draft K tokens from masked q, verify against masked p
    with rejection_sample, continue with the masked target to K+1 tokens. -> counts per sequence."""
    generator = torch.Generator().manual_seed(seed)
    prefixes = {prefix: index for index, prefix in enumerate(table)}
    by_index = list(table)
    allowed = torch.stack([table[p] for p in by_index])                          # [P, S]
    q_table = torch.stack([_masked_probs(draft_logits[p], table[p]) for p in by_index])
    p_table = torch.stack([_masked_probs(target_logits[p], table[p]) for p in by_index])
    child = torch.tensor([[prefixes.get(p + (t,), 0) for t in range(support_size)] for p in by_index])
    assert allowed.any(dim=-1).all()

    root = torch.zeros(SAMPLES, dtype=torch.long)
    node, drafts, draft_rows, nodes = root, [], [], [root]
    for _ in range(K):
        rows = q_table[node]
        token = torch.multinomial(rows, 1, generator=generator).squeeze(-1)
        drafts.append(token)
        draft_rows.append(rows)
        node = child[node, token]
        nodes.append(node)
    target_rows = torch.stack([p_table[n] for n in nodes], dim=1)                # [N, K+1, S]
    output = rejection_sample(torch.stack(drafts, dim=1), torch.stack(draft_rows, dim=1), target_rows, generator)
    sequences = output.clone()
    node = root
    for position in range(K + 1):
        missing = sequences[:, position] == PLACEHOLDER_TOKEN_ID
        if missing.any():
            sampled = torch.multinomial(p_table[node[missing]], 1, generator=generator).squeeze(-1)
            sequences[missing, position] = sampled
        if position < K:
            node = child[node, sequences[:, position]]
    counts: dict[tuple[int, ...], int] = {}
    for row in map(tuple, sequences.tolist()):
        counts[row] = counts.get(row, 0) + 1
    return counts


def _verdict(counts, exact):
    """(chi-square p-value with cells of expected count < 5 pooled, total variation distance)."""
    expected = {seq: probability * SAMPLES for seq, probability in exact.items()}
    unexpected = sum(n for seq, n in counts.items() if seq not in exact)
    big = [seq for seq, e in expected.items() if e >= 5]
    small = [seq for seq in expected if seq not in big]
    observed = [counts.get(seq, 0) for seq in big] + [sum(counts.get(seq, 0) for seq in small) + unexpected]
    wanted = [expected[seq] for seq in big] + [sum(expected[seq] for seq in small) + 1e-9]
    p_value = stats.chisquare(observed, np.array(wanted) * sum(observed) / sum(wanted)).pvalue
    tv = 0.5 * (sum(abs(counts.get(seq, 0) / SAMPLES - p) for seq, p in exact.items()) + unexpected / SAMPLES)
    return p_value, tv


def test_speculation_over_masked_rows_follows_the_masked_target_and_wrong_masks_are_caught(tokenizer, compiler):
    support = _support(tokenizer)
    table = _mask_table(tokenizer, compiler, support)
    target_logits, draft_logits = _rows(1, len(support)), _rows(2, len(support))
    exact = _exact(table, target_logits, len(support))
    assert abs(sum(exact.values()) - 1.0) < 1e-6

    p_value, tv = _verdict(_speculative_samples(table, target_logits, draft_logits, len(support), seed=3), exact)
    # TV bound: what exact sampling of SAMPLES outputs stays under 99.9% of the time (a fixed 0.01
    # sat at the mean's edge for this many outputs and failed by chance when the sampler's stream moved).
    bound = null_tv_bound(torch.tensor(list(exact.values())), SAMPLES, draws=200)
    assert p_value > 1e-3 and tv < bound, (p_value, tv, bound)

    # Broken: draft and target rows masked with the committed state's mask at every position
    # (the draft tokens of the block not walked through). The output leaves the grammar's language.
    wrong = _mask_table(tokenizer, compiler, support, wrong_state=True)
    p_value, tv = _verdict(_speculative_samples(wrong, target_logits, draft_logits, len(support), seed=3), exact)
    assert p_value < 1e-6 and tv > 0.05 > 2 * bound, (p_value, tv, bound)
