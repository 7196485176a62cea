"""EAGLE-3 heads, in-process (no Ray): both checkpoint formats load for a Llama-3 look-alike target,
malformed heads are refused naming why, the target engine returns the features the head reads
from the same forward, the head's cached drafting equals drafting from scratch, greedy output
with a head equals target-only output, and a sampled head's tokens follow the q it reports over
the target's vocabulary (docs/eagle3.md).

The equalities asserted here hold on CPU in float32, where the tests run; on a GPU in bf16 greedy
output may differ at near-ties and with what shares a batch (docs/gpu.md)."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specserve.decoding.target_features import TargetFeatures
from specserve.decoding.block_manager import ForwardCall
from specserve.decoding.eagle3_checkpoint import (Eagle3CheckpointError, default_aux_layers, head_format,
                                                  load_eagle3_head)
from specserve.decoding.eagle3_head import HeadKV
from specserve.decoding.eagle3_proposer import Eagle3Proposer
from specserve.decoding.generate import generate
from specserve.decoding.lean_forward import rope_signs
from specserve.decoding.model_runner import load_causal_lm
from specserve.decoding.proposers import ProposeCall
from specserve.decoding.sampling import SamplingParams, make_generator
from specserve.decoding.scheduler import engine_for_model
from specserve.decoding.sequence import RequestState
from tests.eagle3_fixtures import SPECULATORS_LAYERS, build_eagle3_head, llama3_with_heads
from tests.test_generate import assert_follows_target_not_draft
from tests.test_weight_layout import input_major, linear_weights

FORMATS = ("eagle", "speculators")
PROMPTS = [[5, 17, 42, 8, 3, 33], [60, 2, 2, 9, 14, 27, 50, 11, 7], [12, 40, 21]]
NUM_OUTPUT_TOKENS = 40


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    """(family, target model in float32, {format: head folder})."""
    family, heads = llama3_with_heads(tmp_path_factory.mktemp("eagle3"))
    target = load_causal_lm(str(family.target), dtype="float32", device="cpu")
    return family, target, heads


def test_the_format_is_read_from_config_json(llama3):
    family, _, heads = llama3
    assert head_format(heads["eagle"]) == "eagle"
    assert head_format(heads["speculators"]) == "speculators"
    assert head_format(family.draft) is None


@pytest.mark.parametrize("form", FORMATS)
def test_a_head_loads_the_files_weights_under_their_names(llama3, form):
    """Each of the layer's weights lands where the format's name says (a swapped k/v or a missed
    prefix would not)."""
    _, target, heads = llama3
    folder = heads[form]
    saved = (load_file(str(folder / "model.safetensors")) if form == "speculators"
             else torch.load(folder / "pytorch_model.bin", weights_only=True))
    prefix = "layers.0." if form == "speculators" else "midlayer."
    head = load_eagle3_head(folder, target).head
    pairs = {"self_attn.q_proj.weight": head.q_proj.weight, "self_attn.k_proj.weight": head.k_proj.weight,
             "self_attn.v_proj.weight": head.v_proj.weight, "self_attn.o_proj.weight": head.o_proj.weight,
             "mlp.down_proj.weight": head.down_proj.weight, "hidden_norm.weight": head.hidden_norm,
             "input_layernorm.weight": head.input_layernorm}
    for name, loaded in pairs.items():
        assert torch.equal(loaded, saved[prefix + name].float()), name
    assert torch.equal(head.fc.weight, saved["fc.weight"].float())
    assert torch.equal(head.draft_to_target, torch.arange(len(saved["d2t"])) + saved["d2t"])
    assert torch.equal(head.draft_to_target, saved["t2d"].nonzero().squeeze(-1))
    assert head.embed is target.get_input_embeddings()
    assert head.shape.norm_before_residual == (form == "speculators")
    # Stored input-major on the CPU (decoding/weight_layout.py), values as saved.
    assert all(input_major(weight) for weight in linear_weights(head).values())


def test_the_target_layers_come_from_the_config_else_the_common_default(llama3):
    _, target, heads = llama3
    assert load_eagle3_head(heads["speculators"], target).aux_layers == tuple(SPECULATORS_LAYERS)
    assert load_eagle3_head(heads["eagle"], target).aux_layers == default_aux_layers(2)
    assert default_aux_layers(32) == (2, 16, 29)       # Llama-3.1-8B, as vLLM picks
    assert default_aux_layers(8) == (2, 4, 5)          # the shipped target


def test_the_heads_rotary_embedding_is_the_targets(llama3):
    """Llama-3 rope scaling read from the head's config, as the target reads its own."""
    _, target, heads = llama3
    head = load_eagle3_head(heads["eagle"], target).head
    assert head.rotary.rope_type == "llama3"
    assert torch.allclose(head.rotary.inv_freq, target.model.rotary_emb.inv_freq)


def test_the_heads_rope_tables_answer_what_its_rotary_module_computes_bit_for_bit(llama3):
    """A step reads cos and sin from tables made once; they must be the module's own numbers at
    every position, those past the first table's end (which grow it) included."""
    _, target, heads = llama3
    head = load_eagle3_head(heads["eagle"], target).head
    for positions in ([3, 0, 7], [200, 255], [256, 1000], [5]):   # the first table holds 0..255
        cos, signed_sin = head._rope(torch.tensor(positions), max(positions) + 1, torch.float32)
        expected_cos, expected_sin = head.rotary(torch.empty(0), torch.tensor([positions]))
        assert torch.equal(cos, expected_cos[0])
        assert torch.equal(signed_sin, rope_signs(expected_sin)[0])
    assert head._rope_table[0].shape[0] >= 1001


def malformed(folder, tmp_path, edit_config=None, edit_weights=None):
    copy = tmp_path / "malformed"
    shutil.copytree(folder, copy)
    if edit_config:
        config = json.loads((copy / "config.json").read_text())
        edit_config(config)
        (copy / "config.json").write_text(json.dumps(config))
    if edit_weights:
        weights = load_file(str(copy / "model.safetensors"))
        edit_weights(weights)
        save_file(weights, str(copy / "model.safetensors"))
    return copy


@pytest.mark.parametrize("edit_config, edit_weights, why", [
    (lambda c: c.update(target_hidden_size=128), None, "hidden size 128"),
    (None, lambda w: w.update({"fc.weight": torch.zeros(64, 3 * 128)}), "fusion layer fc"),
    (None, lambda w: w.pop("d2t"), "no d2t"),
    (None, lambda w: w.update(d2t=w["d2t"] + 10 ** 6), "outside the target's vocabulary"),
    (lambda c: c["transformer_layer_config"].update(vocab_size=32000), None, "vocabulary has 32000"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 1, 5]), None, "must name 3 of the target's 2 layers"),
    (lambda c: c["transformer_layer_config"].update(num_hidden_layers=2), None, "2 decoder layers"),
    (lambda c: c.pop("speculators_model_type"), None, "names no EAGLE-3 head"),
])
def test_a_malformed_head_is_refused_naming_why(llama3, tmp_path, edit_config, edit_weights, why):
    _, target, heads = llama3
    with pytest.raises(Eagle3CheckpointError, match=why):
        load_eagle3_head(malformed(heads["speculators"], tmp_path, edit_config, edit_weights), target)


@pytest.mark.parametrize("lean_forward", [True, False])
def test_the_engine_returns_the_aux_layers_inputs_of_every_computed_position(llama3, lean_forward):
    """Compared with transformers' own hidden_states (layer i's input is hidden_states[i]), for a
    prefill and for a verify-like step over a held sequence."""
    _, target, _ = llama3
    layers = (1, 0, 1)
    engine = engine_for_model(target, aux_layers=layers, lean_forward=lean_forward)
    history = PROMPTS[1]
    _, (prefill,) = engine.forward_batch_with_features([ForwardCall("s", history[:5])])
    _, (step,) = engine.forward_batch_with_features([ForwardCall("s", history, 4)])
    with torch.no_grad():
        hidden = target(torch.tensor([history]), output_hidden_states=True).hidden_states
    expected = torch.cat([hidden[layer][0] for layer in layers], dim=-1)
    assert prefill.start == 0 and prefill.hidden.shape == (5, 3 * 64)
    assert step.start == 5 and step.hidden.shape == (4, 3 * 64)
    assert torch.allclose(torch.cat([prefill.hidden, step.hidden]), expected, atol=1e-5)


@pytest.mark.parametrize("lean_forward", [True, False])
def test_a_prefix_cache_hit_answers_the_features_of_the_positions_it_reuses(llama3, lean_forward):
    """The target keeps every position's features in its KV blocks: a sequence whose prefix is
    found in the cache computes only its suffix, and its features from position 0 (the reused
    blocks' written by another sequence's forward, a copy-on-write block's copied with its keys)
    equal transformers' hidden_states over its own history; without them a head could not make
    its entries for the reused positions."""
    from specserve.training.train_eagle3 import target_features

    _, target, _ = llama3
    layers = (1, 0, 1)
    engine = engine_for_model(target, aux_layers=layers, lean_forward=lean_forward)
    assert engine.runner.prefix_caching and engine.blocks.block_size == 16
    shared = [(7 * i + 3) % 500 for i in range(40)]   # two full blocks and a part
    engine.forward_batch_with_features([ForwardCall("first", shared + [19, 23])])
    _, (suffix,) = engine.forward_batch_with_features([ForwardCall("suffix", shared + [44, 1, 6])], [0])
    assert engine.blocks.prefix_cached_tokens("suffix") == 32 and engine.last_num_new_tokens == 11
    # "first" cropped into its second block, which "suffix" shares: it writes into a copy
    _, (cropped,) = engine.forward_batch_with_features([ForwardCall("first", shared[:20] + [5, 6])], [0])
    assert engine.blocks.table("first", 0)[1] != engine.blocks.table("suffix", 0)[1]
    for history, features in ((shared + [44, 1, 6], suffix), (shared[:20] + [5, 6], cropped)):
        expected = target_features(target, torch.tensor([history]), layers)[0][0]
        assert features.start == 0 and features.hidden.shape == expected.shape
        assert torch.allclose(features.hidden, expected, atol=1e-5)


def test_an_engine_without_aux_layers_computes_no_features(llama3):
    _, target, _ = llama3
    engine = engine_for_model(target)
    with pytest.raises(ValueError, match="without aux_layers"):
        engine.forward_batch_with_features([ForwardCall("s", PROMPTS[0])])


def head_from_scratch(loaded, target, history: list[int], num_tokens: int, forced: list[int] = ()) -> list[int]:
    """Greedy drafting with no cache: every step recomputes the head over the whole sequence from
    the target's features of history[:-1] and the head's own outputs after them. forced: tokens
    fed first as drafted ones are, not drawn (a pre-draft's outcome: the block's kept tokens and
    the one emitted after them)."""
    head = loaded.head
    with torch.no_grad():
        hidden = target(torch.tensor([history]), output_hidden_states=True).hidden_states
    features = head.fuse(torch.cat([hidden[layer][0] for layer in loaded.aux_layers], dim=-1))[:-1]
    tokens, drafted = list(history), []
    with torch.no_grad():
        for index in range(len(forced) + num_tokens):
            step = head.step(torch.tensor(tokens[1:]), features, 0)
            best = forced[index] if index < len(forced) else int(head.draft_to_target[step.logits[-1].argmax()])
            drafted += [] if index < len(forced) else [best]
            tokens.append(best)
            features = torch.cat([features, step.prenorm[-1:]])
    return drafted


def test_the_heads_cache_keeps_its_entries_as_it_grows_and_a_write_replaces_what_it_covers():
    """HeadKV: entries written past its capacity grow it without losing those before; a round's
    drafted entries are written over by the next round's at the same positions."""
    kv = HeadKV(num_kv_heads=2, head_dim=3, dtype=torch.float32, device=torch.device("cpu"), capacity=2)
    rows = torch.randn(2, 9, 3), torch.randn(2, 9, 3)
    kv.write(0, rows[0][:, :3], rows[1][:, :3])
    kv.write(3, rows[0][:, 3:4], rows[1][:, 3:4])
    kv.write(4, torch.zeros(2, 5, 3), torch.zeros(2, 5, 3))     # drafted, then dropped
    kv.write(4, rows[0][:, 4:9], rows[1][:, 4:9])
    keys, values = kv.entries(9)
    assert torch.equal(keys, rows[0]) and torch.equal(values, rows[1])
    assert kv.entries(4)[0].shape == (2, 4, 3)


def test_a_batched_step_over_several_sequences_writes_and_answers_what_each_alone_does(small):
    """Eagle3Head.step_sequences (the proposer's one head call a step, and for the entries each
    round committed): each sequence's rows, however many, write the entries its own step writes,
    and it answers the output of its last row, the one that drafts next."""
    _, loaded = small
    head = loaded.head
    torch.manual_seed(2)
    tokens, features = torch.tensor([5, 9, 3, 60, 7, 11, 2]), head.fuse(torch.randn(7, 3 * 32))
    alone, together = [head.new_kv(), head.new_kv()], [head.new_kv(), head.new_kv()]
    with torch.no_grad():
        for kvs in (alone, together):   # each sequence holds 2 entries already
            head.step(tokens[:2], features[:2], 0, kvs[0])
            head.step(tokens[5:7], features[5:7], 0, kvs[1])
        # sequence 0 brings 3 rows at positions 2..4, sequence 1 one row at position 2
        expected = [head.step(tokens[2:5], features[2:5], 2, alone[0]), head.step(tokens[:1], features[:1], 2, alone[1])]
        steps = head.step_sequences(torch.cat([tokens[2:5], tokens[:1]]), torch.cat([features[2:5], features[:1]]),
                                    [2, 2], [3, 1], together)
    for step, whole, kv, kv_alone, end in zip(steps, expected, together, alone, (5, 3)):
        assert step.logits.shape[0] == step.prenorm.shape[0] == 1
        assert torch.allclose(step.logits[0], whole.logits[-1], atol=1e-5)
        assert torch.allclose(step.prenorm[0], whole.prenorm[-1], atol=1e-5)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(kv.entries(end), kv_alone.entries(end)))


def test_a_compiled_heads_steps_answer_what_the_eager_heads_do(small):
    """compile_steps (asked for on CPU: enforce_eager False) compiles both dense parts, and steps
    of one row and of several, alone and batched, answer the eager head's scores and features
    within float32 rounding; the eager head's path is left as it was."""
    _, loaded = small
    eager = loaded.head
    compiled = copy.deepcopy(eager)
    described = compiled.compile_steps(enforce_eager=False, name="small head")
    assert all(not part.eager for part in compiled.compiled_steps), described
    assert eager.compiled_steps is None
    torch.manual_seed(3)
    tokens, features = torch.tensor([5, 9, 3, 60, 7, 11, 2]), eager.fuse(torch.randn(7, 3 * 32))
    with torch.inference_mode():
        answers = []
        for head in (eager, compiled):
            kvs = [head.new_kv(), head.new_kv()]
            steps = [head.step(tokens[:4], features[:4], 0, kvs[0]), head.step(tokens[4:5], features[4:5], 0, kvs[1])]
            steps += head.step_sequences(tokens[5:7], features[5:7], [4, 1], [1, 1], kvs)
            answers.append(steps)
    for expected, got in zip(*answers):
        torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.prenorm, expected.prenorm, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", FORMATS)
def test_drafting_over_the_heads_kept_entries_equals_drafting_from_scratch(llama3, form):
    """Round after round (the target verifying, the history growing by what it commits), the
    proposer's greedy block is the one the head drafts recomputing everything."""
    _, target, heads = llama3
    loaded = load_eagle3_head(heads[form], target)
    engine = engine_for_model(target, aux_layers=loaded.aux_layers)
    proposer = Eagle3Proposer(loaded)
    state = RequestState(request_id="r", prompt_ids=PROMPTS[0], params=SamplingParams(temperature=0, max_tokens=12),
                         eos_token_id=None, max_context=256)
    rounds = 0
    for _ in generate(engine, state, proposer, num_draft_tokens=3):
        if state.finished:
            break
        rounds += 1
        probe = Eagle3Proposer(loaded)
        reference = head_from_scratch(loaded, target, state.history, 3)
        _, (features,) = engine.forward_batch_with_features([ForwardCall("probe", state.history)], [0])
        probe.observe("probe", features)
        assert probe.propose("probe", state.history, 3, state.params).token_ids == reference
        assert proposer.propose_batch([ProposeCall("r", state.history, 3, state.params)])[0].token_ids == reference
        engine.release("probe")
    assert rounds >= 3


@pytest.mark.parametrize("form", FORMATS)
def test_requests_drafting_together_each_get_the_block_it_drafts_alone(llama3, form):
    """propose_batch runs the head once over every request's row a step: each request's greedy
    block, and a sampled seeded one's tokens, are those it drafts alone (different histories,
    blocks of different lengths, one call with nothing to draft)."""
    _, target, heads = llama3
    loaded = load_eagle3_head(heads[form], target)
    engine = engine_for_model(target, aux_layers=loaded.aux_layers)
    together, alone = Eagle3Proposer(loaded), Eagle3Proposer(loaded)
    histories = {f"r{i}": list(prompt) for i, prompt in enumerate(PROMPTS[:3])}
    _, features = engine.forward_batch_with_features([ForwardCall(seq_id, history)
                                                      for seq_id, history in histories.items()])
    for (seq_id, _), rows in zip(histories.items(), features):
        together.observe(seq_id, rows)
        alone.observe(seq_id, rows)
    greedy, sampled = SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=3)
    calls = [ProposeCall("r0", histories["r0"], 4, greedy), ProposeCall("r1", histories["r1"], 2, greedy),
             ProposeCall("r2", histories["r2"], 3, sampled, make_generator(3)),
             ProposeCall("r1", histories["r1"], 0, greedy)]
    batched = together.propose_batch(calls)
    for call, proposal in zip(calls, batched):
        generator = make_generator(3) if call.generator is not None else None
        own = alone.propose_batch([ProposeCall(call.seq_id, call.history, call.num_tokens, call.params, generator)])[0]
        assert proposal.token_ids == own.token_ids, call.seq_id
    assert [len(proposal.token_ids) for proposal in batched] == [4, 2, 3, 0]


@pytest.fixture(scope="module")
def target_only_outputs(llama3):
    _, target, _ = llama3
    outputs = []
    for prompt in PROMPTS:
        state = RequestState(request_id="t", prompt_ids=prompt, params=SamplingParams(temperature=0,
                             max_tokens=NUM_OUTPUT_TOKENS), eos_token_id=None, max_context=256)
        list(generate(engine_for_model(target), state))
        outputs.append(state.output_ids)
    return outputs


@pytest.mark.parametrize("form", FORMATS)
def test_greedy_with_an_eagle3_head_equals_target_only(llama3, target_only_outputs, form):
    _, target, heads = llama3
    loaded = load_eagle3_head(heads[form], target)
    engine = engine_for_model(target, aux_layers=loaded.aux_layers)
    proposer = Eagle3Proposer(loaded)
    drafted = 0
    for prompt, expected in zip(PROMPTS, target_only_outputs):
        state = RequestState(request_id="h", prompt_ids=prompt, params=SamplingParams(temperature=0,
                             max_tokens=NUM_OUTPUT_TOKENS), eos_token_id=None, max_context=256)
        list(generate(engine, state, proposer, num_draft_tokens=3))
        assert state.output_ids == expected
        drafted += state.stats.num_drafted
    assert drafted > 0 and proposer.sequences == {}


# The sampled tests run on a target with a vocabulary small enough to enumerate (as
# tests/test_generate.py's), four layers so the head reads three distinct ones, and a head whose
# q is spread over 40 of the 64 tokens, so a block is accepted part of the time.
SMALL_VOCAB, SMALL_DRAFT_VOCAB = 64, 40
SAMPLED = SamplingParams(temperature=0.9, top_k=16, top_p=0.95, max_tokens=3)
NUM_SAMPLED_RUNS = 3_000
SAMPLED_PROMPT = [12, 40, 21]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """(target model, loaded head) over a 64-token vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("eagle3-small")
    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=SMALL_VOCAB, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=256, initializer_range=0.2, bos_token_id=0,
                                          eos_token_id=1, pad_token_id=None)).eval()
    target.save_pretrained(root / "target")
    folder = build_eagle3_head(root / "target", root / "head", "speculators", draft_vocab=SMALL_DRAFT_VOCAB,
                               aux_layers=[1, 2, 3], lm_head_scale=0.05)
    return target, load_eagle3_head(folder, target)


def head_q(loaded, target, history: list[int], params: SamplingParams) -> torch.Tensor:
    """The head's first-token distribution over the target's vocabulary, computed from the
    definition: its softmax under params over its own rows, placed at their target ids."""
    from specserve.decoding.sampling import logits_to_probs

    head = loaded.head
    with torch.no_grad():
        hidden = target(torch.tensor([history]), output_hidden_states=True).hidden_states
        features = head.fuse(torch.cat([hidden[layer][0] for layer in loaded.aux_layers], dim=-1))[:-1]
        logits = head.step(torch.tensor(history[1:]), features, 0).logits[-1]
    full = torch.full((SMALL_VOCAB,), float("-inf"))
    full[head.draft_to_target] = logits
    return logits_to_probs(full.unsqueeze(0), params)[0].double()


def test_a_sampled_heads_tokens_follow_the_q_it_reports_over_the_targets_vocabulary(small):
    """10,000 seeded first draft tokens for one history: the q the proposal carries is the head's
    distribution placed at its target ids (zero elsewhere), and the drawn tokens pass a chi-square
    test against it (p > 1e-3) with TV under exact sampling's 99.9% quantile, while the head's
    distribution read at its own row indices as if they were target ids (d2t ignored) is rejected
    with TV over 5 times that bound."""
    target, loaded = small
    params = SamplingParams(temperature=1.0, max_tokens=8)
    engine = engine_for_model(target, aux_layers=loaded.aux_layers)
    history = SAMPLED_PROMPT + [7, 30]
    _, (features,) = engine.forward_batch_with_features([ForwardCall("q", history[:-1])])
    proposer = Eagle3Proposer(loaded)
    proposer.observe("q", features)
    expected = head_q(loaded, target, history, params)
    counts = torch.zeros(SMALL_VOCAB, dtype=torch.float64)
    for seed in range(10_000):
        proposal = proposer.propose("q", history, 1, params, make_generator(seed))
        counts[proposal.token_ids[0]] += 1
    q = torch.zeros(SMALL_VOCAB, dtype=torch.float64)
    q[torch.as_tensor(proposal.support.ids[0]).long()] = torch.as_tensor(proposal.support.probs[0]).double()
    assert torch.allclose(q, expected, atol=1e-5)
    assert float(q[loaded.head.draft_to_target].sum()) == pytest.approx(1.0)
    unmapped = torch.zeros(SMALL_VOCAB, dtype=torch.float64)
    unmapped[:SMALL_DRAFT_VOCAB] = expected[loaded.head.draft_to_target]
    assert_follows_target_not_draft(counts, expected, unmapped)


@pytest.fixture(scope="module")
def sampled_outputs(small):
    """NUM_SAMPLED_RUNS seeded requests of 3 tokens with K=1 from the head: token 0 is the
    prefill's, token 1 the first speculative position (the head's accepted token or the
    recovered one), token 2 the bonus or a plain step's. Run through generate_batch in batches of 250 (the engine's slots).
    At 3,000 runs the head's marginal is rejected with TV about 13 times exact sampling's bound,
    and about 15% of drafts are accepted."""
    from specserve.decoding.generate import generate_batch

    target, loaded = small
    engine = engine_for_model(target, aux_layers=loaded.aux_layers)
    proposer = Eagle3Proposer(loaded)
    outputs, accepted = [], 0
    for first in range(0, NUM_SAMPLED_RUNS, 250):
        states = [RequestState(request_id=f"r{seed}", prompt_ids=SAMPLED_PROMPT, eos_token_id=None, max_context=256,
                               params=SamplingParams(**{**SAMPLED.__dict__, "seed": seed}))
                  for seed in range(first, first + 250)]
        generate_batch(engine, states, proposer, num_draft_tokens=1)
        outputs += [state.output_ids for state in states]
        accepted += sum(state.stats.num_accepted for state in states)
    return torch.tensor(outputs), accepted / NUM_SAMPLED_RUNS


def test_sampled_speculation_with_a_head_preserves_the_target_distribution(small, sampled_outputs):
    """The first speculative position's tokens against the target's exact marginal there
    (enumerating the first token): chi-square does not reject at 1e-3 and TV is under exact
    sampling's 99.9% quantile, while the same test rejects the marginal the head's q would give
    if every draft were accepted, with TV over 5 times the bound."""
    from specserve.decoding.sampling import logits_to_probs

    target, loaded = small
    outputs, _ = sampled_outputs
    with torch.no_grad():
        p0 = logits_to_probs(target(torch.tensor([SAMPLED_PROMPT])).logits[:, -1], SAMPLED)[0].double()
        prefixes = torch.tensor([SAMPLED_PROMPT + [a] for a in range(SMALL_VOCAB)])
        p1 = logits_to_probs(target(prefixes).logits[:, -1], SAMPLED).double()
    target_marginal = p0 @ p1
    head_marginal = sum(p0[a] * head_q(loaded, target, SAMPLED_PROMPT + [a], SAMPLED)
                        for a in range(SMALL_VOCAB) if p0[a] > 0)
    assert_follows_target_not_draft(torch.bincount(outputs[:, 1], minlength=SMALL_VOCAB).double(), target_marginal,
                                    head_marginal)


def test_sampled_runs_exercised_both_acceptance_and_rejection(sampled_outputs):
    """Otherwise the statistics above would say nothing about one of the two paths."""
    assert 0.1 < sampled_outputs[1] < 0.9


def test_training_computes_what_drafting_computes(small):
    """The training-time test's scores at depth j for committed position i equal the proposer's
    head steps drafting j tokens ahead from i (fed the same tokens): a head trained on other
    arithmetic than it drafts with would learn the wrong thing."""
    from specserve.training.train_eagle3 import ttt_forward

    target, loaded = small
    head = loaded.head
    window = torch.tensor([[12, 40, 21, 7, 30, 5, 9, 61, 2, 44]])
    with torch.no_grad():
        hidden = target(window[:, :-1], output_hidden_states=True).hidden_states
        features = torch.cat([hidden[layer] for layer in loaded.aux_layers], dim=-1)
        trained = ttt_forward(head, features, window, ttt_steps=3)
        tokens = window[0].tolist()
        for i in (0, 3, 5):
            kv = head.new_kv()
            committed = head.step(torch.tensor(tokens[1:i + 2]), head.fuse(features[0, :i + 1]), 0, kv)
            prenorm = committed.prenorm[-1:]
            assert torch.allclose(trained[0][0, i], committed.logits[-1], atol=1e-4)
            for depth in (1, 2):
                step = head.step(torch.tensor([tokens[i + 1 + depth]]), prenorm, i + depth, kv)
                assert torch.allclose(trained[depth][0, i], step.logits[0], atol=1e-4)
                prenorm = step.prenorm


def test_generated_windows_keep_their_prefix_and_continue_it_as_the_target_does(small):
    """train_eagle3 --generated-share: a window's first half stays, the rest is the target's own
    continuation through its KV cache. Near temperature 0 that is the target's greedy text, each
    token from a whole forward over everything before it: a continuation fed the wrong cache or
    position would differ."""
    from specserve.training.train_eagle3 import target_continuations

    target, _ = small
    windows = torch.randint(2, SMALL_VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    written = target_continuations(target, windows, 5, 1e-4, torch.Generator().manual_seed(1))
    greedy = windows[:, :5]
    with torch.no_grad():
        for _ in range(7):
            greedy = torch.cat([greedy, target(greedy).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert written.shape == windows.shape
    assert torch.equal(written, greedy)


def test_head_agreement_reads_the_tokens_drafting_proposes(small):
    """bench/figures/head_agreement.py: at depth j a head's token at each row of the target's
    continuation is the one greedy drafting proposes j tokens past that row's committed history
    (the window's tokens fed as drafted ones; its reduced vocabulary mapped to target ids); a draft
    model that is the target has every round accepted whole."""
    from specserve.bench.figures.head_agreement import continuation, head_drafts, measure
    from specserve.training.train_eagle3 import target_features

    target, loaded = small
    window, prompt_len = continuation(target, SAMPLED_PROMPT, 8)
    tokens = window[0].tolist()
    features, _ = target_features(target, window[:, :-1], loaded.aux_layers)
    depth1, depth2 = head_drafts(loaded.head, features, window, 2)
    for m in range(prompt_len + 1, len(tokens)):    # row m - 2 drafts token m at depth 1
        assert depth1[m - 2] == head_from_scratch(loaded, target, tokens[:m], 1)[0]
        if m + 1 < len(tokens):
            assert depth2[m - 2] == head_from_scratch(loaded, target, tokens[:m], 1, forced=[tokens[m]])[0]
    report = measure(target, target, {"head": (loaded.head, loaded.aux_layers)}, [SAMPLED_PROMPT], 8, 2)
    assert report["rounds"] == len(tokens) - prompt_len - 2 == 6     # first drafts prompt_len + 1 .. end - 1
    assert report["acceptance"]["draft model"] == [1.0, 1.0] and report["tokens_per_pass"]["draft model"][2] == 3.0


def test_a_round_accepts_its_leading_run_of_right_drafts():
    from specserve.bench.figures.head_agreement import accepted_runs

    right = torch.tensor([[True, True, False, True], [False, True, True, True], [True, True, True, True]])
    assert accepted_runs(right).tolist() == [2, 0, 4]


def test_a_head_exported_with_a_reduced_vocabulary_scores_its_tokens_as_the_whole_head_does(small, tmp_path):
    """train_eagle3 --draft-vocab N: the stream's N most frequent tokens, ascending; the exported
    head reads back (d2t naming them) and scores them exactly as the head over the whole
    vocabulary does, and nothing else (-inf at every other target id)."""
    from specserve.training.train_eagle3 import frequent_tokens, new_head, save_head, with_vocabulary

    target, loaded = small
    stream = torch.tensor([9] * 5 + [3] * 4 + [50] * 3 + [7] * 2 + [1])
    assert frequent_tokens(stream, 3, SMALL_VOCAB).tolist() == [3, 9, 50]
    torch.manual_seed(1)
    whole = new_head(target, loaded.aux_layers).eval()
    target.save_pretrained(tmp_path / "target")
    ids = torch.tensor([3, 9, 20, 50, 63])
    folder = save_head(with_vocabulary(whole, ids), loaded.aux_layers, tmp_path / "target", tmp_path / "head")
    reduced = load_eagle3_head(folder, target).head
    assert reduced.shape.draft_vocab_size == 5 and reduced.draft_to_target.tolist() == ids.tolist()
    features, tokens = torch.randn(4, 3 * 32), torch.tensor([5, 9, 3, 60])
    with torch.no_grad():
        expected = whole.step(tokens, whole.fuse(features), 0).logits
        scores = reduced.target_logits(reduced.step(tokens, reduced.fuse(features), 0).logits, SMALL_VOCAB)
    assert torch.allclose(scores[:, ids], expected[:, ids], atol=1e-5)
    outside = torch.ones(SMALL_VOCAB, dtype=torch.bool).index_fill_(0, ids, False)
    assert torch.isneginf(scores[:, outside]).all()


def test_a_pre_draft_continues_the_heads_block_on_its_own_features_as_eagle3_drafts(small):
    """A pre-draft for an outcome of verifying the head's block (decoding.speculation_cache): the
    entries of the kept block tokens are the block's own, drafted from the head's own features,
    and the emitted token's entry reads the feature the block's step before it produced (the
    target's are not computed yet). Each outcome's greedy block equals drafting from scratch with
    the outcome's tokens fed as drafted ones; a history that does not continue the block makes
    nothing; adopt hands the used branch's block to its request."""
    target, loaded = small
    engine = engine_for_model(target, aux_layers=loaded.aux_layers)
    proposer = Eagle3Proposer(loaded)
    greedy = SamplingParams(temperature=0)
    history = SAMPLED_PROMPT + [7, 30, 2, 9]
    _, (features,) = engine.forward_batch_with_features([ForwardCall("s", history)], [0])
    proposer.observe("s", features)
    block = proposer.propose_batch([ProposeCall("s", history, 4, greedy, num_candidates=2)])[0].token_ids
    assert block == head_from_scratch(loaded, target, history, 4)
    other = next(token for token in range(2, SMALL_VOCAB) if token not in block)
    outcomes = [[other], block[:2] + [other], block]        # rejected first; rejected third; all kept (bonus)
    for index, outcome in enumerate(outcomes):
        assert proposer.fork("s", f"b{index}", history + outcome)
        drafted = proposer.propose_batch([ProposeCall(f"b{index}", history + outcome, 3, greedy,
                                                      num_candidates=2)])[0].token_ids
        assert drafted == head_from_scratch(loaded, target, history, 3, outcome), outcome
    assert not proposer.fork("s", "x", history[:-1] + [other] + block[:1])     # not the committed history
    assert not proposer.fork("s", "x", history + [other, other])               # two tokens after a rejection
    assert "x" not in proposer.sequences
    branch_block = proposer.sequences["b1"].block
    assert branch_block.history == tuple(history + outcomes[1])
    proposer.adopt("s", "b1")
    assert proposer.sequences["s"].block is branch_block and "b1" not in proposer.sequences


def test_a_head_without_the_targets_features_says_which_positions_it_needs(small):
    """A target run without the head's aux layers (or whose prefix cache skipped positions) gives
    the proposer nothing to make its entries from: it says so instead of drafting from garbage."""
    from specserve.decoding.errors import SequenceStateError

    target, loaded = small
    engine = engine_for_model(target, aux_layers=loaded.aux_layers)
    proposer = Eagle3Proposer(loaded)
    history = SAMPLED_PROMPT + [7, 30]
    with pytest.raises(SequenceStateError, match=r"positions 0\.\.3, it has none"):
        proposer.propose("s", history, 2, SamplingParams(temperature=0))
    _, (features,) = engine.forward_batch_with_features([ForwardCall("late", history)])
    proposer.observe("late", TargetFeatures(2, features.hidden[2:]))
    with pytest.raises(SequenceStateError, match=r"positions 0\.\.3, it has 2\.\.4"):
        proposer.propose("late", history, 2, SamplingParams(temperature=0))


def test_a_proposer_names_the_first_position_it_lacks_and_drafts_once_it_has_it(small):
    """What a replacement draft engine answers (UnknownFeatures) and what the router then sends:
    the features from the position it names on, which the target computes again."""
    target, loaded = small
    engine = engine_for_model(target, aux_layers=loaded.aux_layers)
    proposer = Eagle3Proposer(loaded)
    history = SAMPLED_PROMPT + [7, 30]
    greedy = SamplingParams(temperature=0)
    _, (features,) = engine.forward_batch_with_features([ForwardCall("s", history)])
    assert proposer.missing_features("s", history) == 0
    proposer.observe("s", TargetFeatures(0, features.hidden[:2]))
    assert proposer.missing_features("s", history) == 0   # 0..1 held, 2..3 missing: still from 0
    proposer.observe("s", TargetFeatures(2, features.hidden[2:4]))
    assert proposer.missing_features("s", history) is None
    drafted = proposer.propose("s", history, 2, greedy).token_ids
    assert len(drafted) == 2
    # once entries exist, a longer history needs only the new positions' features
    longer = history + [drafted[0], 11]
    assert proposer.missing_features("s", longer) == len(history) - 1
    reference = Eagle3Proposer(loaded)
    _, (whole,) = engine.forward_batch_with_features([ForwardCall("r", longer)])
    reference.observe("r", whole)
    proposer.observe("s", TargetFeatures(len(history) - 1, whole.hidden[len(history) - 1:]))
    assert proposer.propose("s", longer, 3, greedy).token_ids == reference.propose("r", longer, 3, greedy).token_ids
