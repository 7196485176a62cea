"""BatchedModelRunner: ragged full-history calls in one forward over a paged KV cache must give the
rows the per-sequence ReferenceRunner gives, on tiny random Llama, Qwen2, Mistral and GPT-2 (fp32, CPU).
(Paged-specific checks: block accounting, budgets, capacity: tests/test_paged_cache.py.)

The equalities asserted here hold on CPU in float32, where the tests run; on a GPU in bf16 greedy
output may differ at near-ties and with what shares a batch (docs/gpu.md)."""

import logging

import pytest
import torch

import specserve.decoding.batched_runner as batched_runner_module
from specserve.decoding.batched_runner import BatchedModelRunner, UnsupportedModelError, load_runner
from specserve.decoding.block_manager import ForwardCall
from specserve.decoding.errors import NoFreeSlotError, SequenceStateError
from specserve.decoding.generate import generate
from specserve.decoding.proposers import DraftModelProposer
from specserve.decoding.sampling import SamplingParams
from specserve.decoding.scheduler import Scheduler, engine_for_model
from specserve.decoding.sequence import RequestState
from specserve.decoding.paged_cache import PagedBatchView, PagedKVCache, paged_layout
from tests.reference_runner import ReferenceRunner, full_logits
from tests.tiny_pair import ARCHITECTURES, tiny_model

# Batched and unbatched matmuls round differently (~1e-6 here); logits are O(1), so a wrong
# position or mask moves them by far more than this (test_the_tolerance_catches_... proves it).
ATOL = 1e-4


def random_ids(seed: int, length: int, vocab_size: int = 96) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab_size, (length,), generator=generator).tolist()


def ragged_rounds() -> list[list[ForwardCall]]:
    """Three batched steps a verifying engine would see, with every irregularity at once."""
    a, b, c, d = random_ids(1, 40), random_ids(2, 13), random_ids(3, 70), random_ids(4, 25)
    return [
        # Prefills of different lengths.
        [ForwardCall("a", a[:30], 1), ForwardCall("b", b[:5], 1), ForwardCall("c", c[:50], 1)],
        # Verifies with different K (K+1 rows), a prefill among them, and a row that recomputes
        # rows it already holds (c's history equals its cache: at least num_rows are recomputed).
        [ForwardCall("a", a[:35], 6), ForwardCall("b", b[:8], 2), ForwardCall("c", c[:50], 3),
         ForwardCall("d", d[:20], 1)],
        # a diverges from its cache (a rejected tail is replaced: rollback mid-batch), b goes on,
        # c takes one token, d verifies K=4.
        [ForwardCall("a", a[:32] + [7, 8, 9], 4), ForwardCall("b", b, 5), ForwardCall("c", c[:51], 1),
         ForwardCall("d", d, 5)],
        # Rows whose slots are not neighbours (b and d sit this one out): keys are gathered.
        [ForwardCall("c", c[:56], 3), ForwardCall("a", a[:32] + [7, 8, 9, 10], 2)],
    ]


def assert_rows_match(batched: Scheduler, reference: ReferenceRunner, calls: list[ForwardCall]) -> None:
    rows = batched.forward_batch(calls)
    for call, got in zip(calls, rows):
        expected = reference.forward(call.seq_id, call.token_ids, call.num_rows)
        assert got.dtype == torch.float32
        assert got.shape == (call.num_rows, batched.vocab_size)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0, msg=lambda m: f"{call.seq_id}: {m}")


def test_paged_layout_numbers_new_tokens_after_each_rows_cache_and_masks_causally():
    # Row 0: blocks [5, 9] hold 3 tokens and it brings 2; row 1: block [2] holds none and it brings 1
    # (padded to 2). Blocks of 4 tokens.
    layout = paged_layout([[[5, 9], [2]]], starts=[3, 0], num_new=[2, 1], block_size=4, dtype=torch.float32,
                          device=torch.device("cpu"))   # one KV cache group
    assert layout.position_ids.tolist() == [[3, 4], [0, 0]]
    assert layout.kv_length == 5
    # The mask is built on the device from the positions; the padding token copies the last real one.
    view = PagedKVCache(num_layers=1, num_blocks=16, block_size=4).view(layout)
    visible = (view.mask(None)[:, 0] == 0).int().tolist()
    assert visible == [[[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]],
                       [[1, 0, 0, 0, 0], [1, 0, 0, 0, 0]]]
    assert set(view.mask(None).unique().tolist()) == {0.0, torch.finfo(torch.float32).min}
    # Every (row, column) has a token slot (block * 4 + offset); a padding column rewrites its row's
    # last token's slot with that token's keys (write_source).
    blocks = layout.groups[0]
    assert blocks.write_slots.tolist() == [5 * 4 + 3, 9 * 4 + 0, 2 * 4 + 0, 2 * 4 + 0]
    assert layout.write_source.tolist() == [0, 1, 2, 2]
    assert blocks.tables.tolist() == [[5, 9], [2, -1]]
    assert layout.real_tokens.tolist() == [0, 1, 2]


@pytest.mark.parametrize("architecture, lean_forward", [(architecture, False) for architecture in ARCHITECTURES]
                         + [(architecture, True) for architecture in ("llama", "qwen2", "mistral")])
def test_ragged_batches_give_the_unbatched_rows(monkeypatch, architecture, lean_forward):
    # Whatever attention the model was built with, the engine runs decoding.paged_attention;
    # the lean forward (Llama-shaped models only) runs the same attention with its own layers.
    model = tiny_model(architecture)
    batched, reference = engine_for_model(model, max_sequences=256, lean_forward=lean_forward), ReferenceRunner.from_model(model)
    assert isinstance(batched.runner, BatchedModelRunner)
    for calls in ragged_rounds():
        assert_rows_match(batched, reference, calls)
    # A released sequence's blocks are reused by a new one, which must not see the old keys.
    freed = list(batched.blocks._sequences["b"].tables[0])
    batched.release("b")
    reference.release("b")
    assert_rows_match(batched, reference, [ForwardCall("e", random_ids(5, 9), 3),
                                           ForwardCall("a", random_ids(1, 40)[:36], 2)])
    assert batched.blocks._sequences["e"].tables[0] == freed[:1]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_batched_rows_equal_a_cache_free_forward(architecture):
    model = tiny_model(architecture)
    engine = engine_for_model(model)
    histories = {"x": random_ids(6, 17), "y": random_ids(7, 60), "z": random_ids(8, 3)}
    engine.forward_batch([ForwardCall(seq_id, history[:-2], 1) for seq_id, history in histories.items()])
    rows = engine.forward_batch([ForwardCall(seq_id, history, 3) for seq_id, history in histories.items()])
    for (seq_id, history), got in zip(histories.items(), rows):
        torch.testing.assert_close(got, full_logits(model, history)[-3:], atol=ATOL, rtol=0)


def positions_without_the_cached_length(layout_fn):
    """The classic bug: new tokens numbered from 0 instead of from the row's cached length. (A
    uniform shift of every position would be invisible to RoPE, rightly.)"""
    def layout(*args, **kwargs):
        good = layout_fn(*args, **kwargs)
        return type(good)(**{**good.__dict__, "position_ids": good.position_ids - good.position_ids[:, :1]})
    return layout


@pytest.mark.parametrize("architecture", ["llama", "gpt2", "gemma2"])
def test_the_tolerance_catches_wrong_positions(monkeypatch, architecture):
    """The equality tests above can fail: wrong position ids (rotary, learned positions, the
    soft-capped path) move rows by orders of magnitude more than ATOL."""
    model = tiny_model(architecture)
    reference = ReferenceRunner.from_model(model)
    monkeypatch.setattr(batched_runner_module, "paged_layout", positions_without_the_cached_length(paged_layout))
    broken = engine_for_model(model, lean_forward=False)
    worst = 0.0
    for calls in ragged_rounds():
        for call, got in zip(calls, broken.forward_batch(calls)):
            expected = reference.forward(call.seq_id, call.token_ids, call.num_rows)
            worst = max(worst, float((got - expected).abs().max()))
    assert worst > 100 * ATOL


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_greedy_generation_through_the_batched_runner_equals_model_runner(architecture):
    model = tiny_model(architecture)
    params = SamplingParams(temperature=0, max_tokens=40)

    def decode(engine, prompt: list[int]) -> list[int]:
        state = RequestState(request_id="r", prompt_ids=prompt, params=params, eos_token_id=None,
                             max_context=engine.max_context)
        for _ in generate(engine, state):
            pass
        return state.output_ids

    for seed, length in [(10, 5), (11, 23), (12, 1)]:
        prompt = random_ids(seed, length)
        assert decode(engine_for_model(model), prompt) == decode(ReferenceRunner.from_model(model), prompt)


def test_speculative_greedy_over_batched_target_and_draft_equals_target_only():
    target, draft = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    params = SamplingParams(temperature=0, max_tokens=30)
    outputs = []
    for proposer in (None, DraftModelProposer(engine_for_model(draft))):
        state = RequestState(request_id="r", prompt_ids=random_ids(13, 6), params=params, eos_token_id=None,
                             max_context=128)
        for _ in generate(engine_for_model(target), state, proposer, num_draft_tokens=4):
            pass
        outputs.append(state.output_ids)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 30


def test_lockstep_greedy_decoding_of_many_requests_equals_each_alone():
    """What a batching engine does: every live request advances one token per forward."""
    model = tiny_model("llama")
    prompts = {f"r{i}": random_ids(20 + i, length) for i, length in enumerate([3, 17, 8, 30, 1])}
    num_new = {seq_id: 10 + 5 * i for i, seq_id in enumerate(prompts)}   # requests finish at different steps
    engine = engine_for_model(model, max_sequences=len(prompts))
    histories = {seq_id: list(prompt) for seq_id, prompt in prompts.items()}
    while live := [seq_id for seq_id in histories if len(histories[seq_id]) < len(prompts[seq_id]) + num_new[seq_id]]:
        rows = engine.forward_batch([ForwardCall(seq_id, histories[seq_id]) for seq_id in live])
        for seq_id, row in zip(live, rows):
            histories[seq_id].append(int(row[0].argmax()))
    for seq_id, prompt in prompts.items():
        alone, ids = ReferenceRunner.from_model(model), list(prompt)
        for _ in range(num_new[seq_id]):
            ids.append(int(alone.forward("s", ids)[0].argmax()))
        assert histories[seq_id] == ids


def count_processed_tokens(engine: Scheduler) -> list[tuple[int, int]]:
    """Record the [rows, new tokens] shape each forward feeds through the model."""
    shapes: list[tuple[int, int]] = []
    engine.runner.model.get_input_embeddings().register_forward_hook(
        lambda module, args, output: shapes.append(tuple(args[0].shape)))
    return shapes


def test_forward_batch_reuses_cached_prefixes_and_pads_to_the_longest_remainder():
    engine = engine_for_model(tiny_model("llama"))
    shapes = count_processed_tokens(engine)
    a, b = random_ids(30, 20), random_ids(31, 10)
    engine.forward_batch([ForwardCall("a", a), ForwardCall("b", b)])
    engine.forward_batch([ForwardCall("a", a + [5, 6, 7], 4), ForwardCall("b", b[:6] + [9], 1)])
    assert shapes == [(2, 20), (2, 4)]
    assert (engine.blocks.num_cached("a"), engine.blocks.num_cached("b")) == (23, 7)


def test_rollback_crops_to_a_length_and_the_next_call_recomputes_from_there():
    model = tiny_model("llama")
    engine = engine_for_model(model)
    shapes = count_processed_tokens(engine)
    committed = random_ids(32, 12)
    engine.forward("s", committed + [70, 71, 72], num_rows=4)
    engine.blocks.rollback("s", len(committed))
    assert engine.blocks.num_cached("s") == len(committed)
    rows = engine.forward("s", committed + [33], num_rows=1)
    assert shapes[-1] == (1, 1)
    torch.testing.assert_close(rows, full_logits(model, committed + [33])[-1:], atol=ATOL, rtol=0)
    with pytest.raises(SequenceStateError, match="unknown"):
        engine.blocks.rollback("never-seen", 0)


def test_slots_run_out_at_max_sequences_and_release_frees_one():
    engine = engine_for_model(tiny_model("llama"), max_sequences=3)
    assert engine.blocks.num_free_slots == 3
    engine.forward_batch([ForwardCall("a", [3, 4]), ForwardCall("b", [5])])
    assert engine.blocks.num_free_slots == 1
    # A batch admitting two new sequences where one fits: refused whole, nothing admitted.
    with pytest.raises(NoFreeSlotError, match="max_sequences=3"):
        engine.forward_batch([ForwardCall("c", [6]), ForwardCall("d", [7]), ForwardCall("a", [3, 4, 8])])
    assert sorted(engine.blocks.active_sequences()) == ["a", "b"] and engine.blocks.num_cached("a") == 2
    engine.forward("c", [6])
    with pytest.raises(NoFreeSlotError):
        engine.forward("d", [7])
    assert issubclass(NoFreeSlotError, SequenceStateError)
    engine.release("a")
    engine.release("a")
    engine.release("never-seen")
    assert engine.blocks.num_free_slots == 1
    engine.forward("d", [7])
    assert sorted(engine.blocks.active_sequences()) == ["b", "c", "d"]


def test_a_failed_forward_leaves_held_sequences_valid_and_admits_nothing(monkeypatch):
    model = tiny_model("llama")
    engine, reference = engine_for_model(model), ReferenceRunner.from_model(model)
    history = random_ids(33, 15)
    engine.forward("a", history)

    def failing_forward(*args, **kwargs):
        raise RuntimeError("out of memory")
    with monkeypatch.context() as patch:
        patch.setattr(engine.runner, "_logits", failing_forward)
        with pytest.raises(RuntimeError):
            engine.forward_batch([ForwardCall("a", history[:10] + [4, 5], 2), ForwardCall("new", [3, 4])])
    assert engine.blocks.active_sequences() == ["a"] and engine.blocks.num_cached("a") == 10
    torch.testing.assert_close(engine.forward("a", history, 3), reference.forward("a", history, 3),
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("make_engine", [engine_for_model, ReferenceRunner.from_model])
def test_forward_batch_rejects_bad_batches_before_changing_anything(make_engine):
    engine = make_engine(tiny_model("llama", max_position_embeddings=16))
    engine.forward("a", [3, 4, 5])
    with pytest.raises(ValueError, match="once"):
        engine.forward_batch([ForwardCall("a", [3, 4]), ForwardCall("a", [3, 4, 5])])
    with pytest.raises(SequenceStateError, match="num_rows"):
        engine.forward_batch([ForwardCall("b", [3]), ForwardCall("a", [3, 4], 3)])
    with pytest.raises(SequenceStateError, match="context"):
        engine.forward_batch([ForwardCall("b", [3]), ForwardCall("c", list(range(17)))])
    held = engine.blocks if isinstance(engine, Scheduler) else engine
    assert held.active_sequences() == ["a"] and held.num_cached("a") == 3
    assert engine.forward_batch([]) == []


def test_every_layer_honours_its_own_sliding_window(monkeypatch):
    """Gemma 3's windowed layers see only their last SHORT_WINDOW keys and its global layer all of
    them: the rows equal the model's own. Ignoring the window (every layer global) is caught."""
    model = tiny_model("gemma3")
    histories = {"x": random_ids(9, 40), "y": random_ids(10, 23)}
    engine = engine_for_model(model)
    rows = engine.forward_batch([ForwardCall(seq_id, history, 4) for seq_id, history in histories.items()])
    for history, got in zip(histories.values(), rows):
        torch.testing.assert_close(got, full_logits(model, history)[-4:], atol=ATOL, rtol=0)
    full_attention_mask = PagedBatchView.mask
    monkeypatch.setattr(PagedBatchView, "mask", lambda view, sliding_window: full_attention_mask(view, None))
    broken = engine_for_model(tiny_model("gemma3"))
    got = broken.forward_batch([ForwardCall("x", histories["x"], 4)])[0]
    assert float((got - full_logits(model, histories["x"])[-4:]).abs().max()) > 100 * ATOL


def test_a_model_with_a_layer_outside_the_attention_interface_is_refused_at_load():
    """A layer whose attention never reaches the paged cache (here: one that drops the forward's
    keyword arguments) is refused at load with the reason, not served wrongly."""
    model = tiny_model("llama")
    attention = model.model.layers[1].self_attn
    original = attention.forward

    def forward_without_the_interface(*args, **kwargs):
        kwargs.pop("paged_batch", None)
        return original(*args, **kwargs)

    attention.forward = forward_without_the_interface
    with pytest.raises(UnsupportedModelError, match=r"layers \[1\] of 2 do not attend through"):
        engine_for_model(model, lean_forward=False)


def test_an_encoder_decoder_is_refused_naming_why():
    model = tiny_model("llama")
    model.config.is_encoder_decoder = True
    with pytest.raises(UnsupportedModelError, match="encoder-decoder"):
        engine_for_model(model)


def test_load_runner_loads_a_saved_model(tmp_path):
    model = tiny_model("gpt2")
    model.save_pretrained(tmp_path)
    runner = load_runner({"path": str(tmp_path), "dtype": "float32", "device": "cpu", "torch_threads": 1,
                          "max_sequences": 4})
    assert type(runner) is BatchedModelRunner
    assert (runner.vocab_size, runner.max_context, runner.eos_token_id, runner.max_sequences) == (96, 128, 1, 4)
    assert runner.model_path == str(tmp_path)
    engine = Scheduler(runner)
    history = random_ids(36, 7)
    torch.testing.assert_close(engine.forward("s", history, num_rows=2), full_logits(model, history)[-2:],
                               atol=ATOL, rtol=0)
