"""The engine's full-history protocol over a BatchedModelRunner (reuse, rollback, release, errors) and the
pair checks, on tiny random Llamas (fp32, CPU).

The equalities asserted here hold on CPU in float32, where the tests run; on a GPU in bf16 greedy
output may differ at near-ties and with what shares a batch (docs/gpu.md)."""

import shutil

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from specserve.decoding.batched_runner import BatchedModelRunner
from specserve.decoding.errors import SequenceStateError
from specserve.decoding.model_runner import IncompatibleModelsError, check_compatible, check_compatible_paths
from specserve.decoding.scheduler import Scheduler, engine_for_model
from tests.reference_runner import full_logits
from tests.tiny_pair import make_tiny_pair, tiny_config, tiny_llama

ATOL = 1e-4


def count_processed_tokens(engine: Scheduler) -> list[int]:
    """Record how many tokens each forward feeds through the model."""
    counts: list[int] = []
    engine.runner.model.model.embed_tokens.register_forward_hook(
        lambda module, args, output: counts.append(args[0].shape[1]))
    return counts


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_llama()


def test_verify_block_rows_equal_step_by_step_decode_rows(model):
    history = [5, 17, 42, 8, 3, 77, 12, 30, 64, 9, 11, 2]
    block_engine = engine_for_model(model)
    step_engine = engine_for_model(model)
    prefix_length = 7
    block_rows = block_engine.forward("s", history, num_rows=len(history) - prefix_length + 1)
    step_rows = [step_engine.forward("s", history[:end], num_rows=1)[0]
                 for end in range(prefix_length, len(history) + 1)]
    assert block_rows.dtype == torch.float32
    assert block_rows.shape == (len(history) - prefix_length + 1, model.config.vocab_size)
    torch.testing.assert_close(block_rows, torch.stack(step_rows), atol=ATOL, rtol=0)
    torch.testing.assert_close(block_rows, full_logits(model, history)[prefix_length - 1:], atol=ATOL, rtol=0)


def test_rollback_then_redecode_equals_runner_that_never_speculated(model):
    committed = [4, 8, 15, 16, 23, 42]
    speculative = engine_for_model(model)
    speculative.forward("s", committed + [70, 71, 72], num_rows=4)   # a rejected speculative tail
    speculative.blocks.rollback("s", len(committed))
    assert speculative.blocks.num_cached("s") == len(committed)
    after_rollback = speculative.forward("s", committed + [33], num_rows=1)

    plain = engine_for_model(model)
    reference = plain.forward("s", committed + [33], num_rows=1)
    torch.testing.assert_close(after_rollback, reference, atol=ATOL, rtol=0)


def test_forward_reuses_the_cached_prefix(model):
    engine = engine_for_model(model)
    processed = count_processed_tokens(engine)
    prompt = list(range(10, 30))
    engine.forward("s", prompt, num_rows=1)
    engine.forward("s", prompt + [7, 8, 9], num_rows=3)
    assert processed == [20, 3]
    assert engine.blocks.num_cached("s") == 23


def test_forward_crops_a_diverged_tail(model):
    engine = engine_for_model(model)
    processed = count_processed_tokens(engine)
    shared = list(range(10, 30))
    engine.forward("s", shared + [50, 51, 52, 53], num_rows=5)
    logits = engine.forward("s", shared + [60, 61], num_rows=1)
    assert processed == [24, 2]
    assert engine.blocks.num_cached("s") == 22
    torch.testing.assert_close(logits[0], full_logits(model, shared + [60, 61])[-1], atol=ATOL, rtol=0)


def test_forward_recomputes_at_least_num_rows_of_a_cached_history(model):
    engine = engine_for_model(model)
    processed = count_processed_tokens(engine)
    history = list(range(10, 25))
    engine.forward("s", history, num_rows=1)
    rows = engine.forward("s", history, num_rows=3)
    assert processed == [15, 3]
    torch.testing.assert_close(rows, full_logits(model, history)[-3:], atol=ATOL, rtol=0)


def test_release_is_idempotent_and_frees_the_sequence(model):
    engine = engine_for_model(model)
    engine.forward("a", [3, 4, 5], num_rows=1)
    engine.forward("b", [3, 4], num_rows=1)
    assert sorted(engine.blocks.active_sequences()) == ["a", "b"]
    engine.release("a")
    engine.release("a")
    engine.release("never-seen")
    assert engine.blocks.active_sequences() == ["b"]
    assert engine.blocks.num_cached("a") == 0


def test_forward_rejects_a_history_longer_than_the_context():
    engine = engine_for_model(tiny_llama(max_position_embeddings=16))
    engine.forward("s", list(range(16)), num_rows=1)  # exactly the context is fine
    with pytest.raises(SequenceStateError, match="context"):
        engine.forward("s", list(range(17)), num_rows=1)


def test_forward_rejects_more_rows_than_tokens(model):
    engine = engine_for_model(model)
    with pytest.raises(SequenceStateError, match="num_rows"):
        engine.forward("s", [3, 4], num_rows=3)


def test_forward_rejects_more_than_max_sequences(model):
    engine = engine_for_model(model, max_sequences=2)
    engine.forward("a", [3], num_rows=1)
    engine.forward("b", [3], num_rows=1)
    with pytest.raises(SequenceStateError, match="max_sequences"):
        engine.forward("c", [3], num_rows=1)
    engine.release("a")
    engine.forward("c", [3], num_rows=1)
    assert sorted(engine.blocks.active_sequences()) == ["b", "c"]


def word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer whose ids follow the order of `words`."""
    vocab = {"[UNK]": 0, **{word: i + 1 for i, word in enumerate(words)}}
    tokenizer = Tokenizer(WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")


PROBE_WORDS = ["def", "fibonacci", "(", "n", "):", "return"]


def test_check_compatible_passes_for_a_matching_pair(model):
    check_compatible(BatchedModelRunner.from_model(tiny_llama(seed=1)), BatchedModelRunner.from_model(model),
                     word_tokenizer(PROBE_WORDS), word_tokenizer(PROBE_WORDS))


def test_check_compatible_accepts_padded_widths_and_serves_the_tokenizers_ids(model):
    """Qwen2.5's case: one tokenizer, two embedding widths (both padded past it)."""
    draft = BatchedModelRunner.from_model(tiny_llama(vocab_size=64, seed=1))
    tokenizer = word_tokenizer(PROBE_WORDS)
    assert check_compatible(draft, BatchedModelRunner.from_model(model), tokenizer, tokenizer) == len(tokenizer)


def test_check_compatible_rejects_a_draft_narrower_than_the_tokenizer(model):
    draft = BatchedModelRunner.from_model(tiny_llama(vocab_size=64, seed=1))
    tokenizer = word_tokenizer([f"w{i}" for i in range(80)])
    with pytest.raises(IncompatibleModelsError, match="scores 64 ids.*proposer: none"):
        check_compatible(draft, BatchedModelRunner.from_model(model), tokenizer, tokenizer)


def test_check_compatible_rejects_differing_tokenization(model):
    with pytest.raises(IncompatibleModelsError, match="split .* differently"):
        check_compatible(BatchedModelRunner.from_model(tiny_llama(seed=1)), BatchedModelRunner.from_model(model),
                         word_tokenizer(PROBE_WORDS), word_tokenizer(list(reversed(PROBE_WORDS))))


def test_runner_loads_a_saved_model_from_a_local_directory(model, tmp_path):
    model.save_pretrained(tmp_path)
    runner = BatchedModelRunner(str(tmp_path), dtype="float32", device="cpu")
    assert (runner.vocab_size, runner.max_context, runner.eos_token_id) == (96, 128, 1)
    assert runner.model_path == str(tmp_path)
    history = [5, 6, 7, 8]
    torch.testing.assert_close(Scheduler(runner).forward("s", history, num_rows=2), full_logits(model, history)[-2:],
                               atol=ATOL, rtol=0)


def test_check_compatible_paths_rejects_a_draft_with_another_vocabulary(tmp_path):
    target_path, draft_path = make_tiny_pair(tmp_path)
    check_compatible_paths(str(draft_path), str(target_path))  # the matching pair passes
    LlamaForCausalLM(tiny_config(vocab_size=100)).save_pretrained(tmp_path / "other")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(target_path / name, tmp_path / "other" / name)
    with pytest.raises(IncompatibleModelsError, match="scores 100 ids"):
        check_compatible_paths(str(tmp_path / "other"), str(target_path))
