"""A draft model over a token map (decoding/token_map.py): in a step whose rows are all greedy its
head scores only the map's tokens and the draft proposes nothing else; a sampled row (or a step
mixing them) scores the whole head unless the map is for sampled rows too; speculation over it
stays exact.

The statistical test runs 6,000 seeded requests through the real round path
(decoding.generate.generate_batch: DraftModelProposer over a head mapped for sampled rows too,
target rows, rejection sampling) with a draft that may propose only half of the vocabulary: the emitted tokens' marginal
at the first two speculative positions must pass a chi-square test (p > 1e-3) and stay under exact
sampling's 99.9% TV quantile against the target's exact marginal, while the same test rejects the
mapped draft's own marginal (a sampler that emitted the draft's tokens would fail)."""

import argparse
import copy
import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from specserve.cluster.builder import served_model_specs
from specserve.cluster.cli import add_model_args, config_from_args, draft_line
from specserve.cluster.local import check_model_paths
from specserve.common.config import SpecServeConfig
from specserve.decoding.batched_runner import load_runner
from specserve.decoding.generate import generate
from specserve.decoding.proposers import DraftModelProposer, ProposeCall
from specserve.decoding.sampling import SamplingParams
from specserve.decoding.scheduler import engine_for_model
from specserve.decoding.sequence import RequestState
from specserve.decoding.token_map import (AUTO_TOKEN_MAP, FLOOR, FOLDER_TOKEN_MAP, MappedHead, TokenMapError,
                                          load_token_map, map_lm_head, remap_heads)
from specserve.training.token_map import corpus_texts, token_map
from tests.reference_runner import reference_model
from tests.test_decoder_statistics import PROMPT, VOCAB_SIZE, assert_speculation_follows_the_target
from tests.tiny_pair import make_tiny_pair, tiny_llama

MAP = list(range(0, VOCAB_SIZE, 2))          # half of the vocabulary: what the draft may propose
NUM_REQUESTS = 6_000


def mapped_size(model) -> int | None:
    """How many tokens model's LM head scores where it is a MappedHead, else None."""
    head = model.get_output_embeddings()
    return int(head.token_ids.numel()) if isinstance(head, MappedHead) else None


def mapped_copy(model, token_ids, maps_sampled: bool = False):
    copied = copy.deepcopy(model)
    map_lm_head(copied, torch.tensor(token_ids), maps_sampled)
    return copied


def test_a_map_file_loads_as_ascending_distinct_ids_in_either_format(tmp_path):
    (tmp_path / "map.json").write_text(json.dumps([7, 3, 3, 0]))
    torch.save(torch.tensor([5, 1, 2], dtype=torch.int32), tmp_path / "map.pt")
    assert load_token_map(tmp_path / "map.json", 8).tolist() == [0, 3, 7]
    assert load_token_map(tmp_path / "map.pt", 8).tolist() == [1, 2, 5]


@pytest.mark.parametrize("content, why", [
    (None, "not found"), ("[]", "names no tokens"), ("[1, 2.5]", "integer token ids"), ("[[1, 2]]", "integer token ids"),
    ('{"ids": [1]}', "integer token ids"), ("[1, 8]", "outside the draft's vocabulary of 8"), ("[-1]", "outside"),
    ("not json", "cannot be read")])
def test_a_map_that_cannot_be_served_is_refused_naming_why(tmp_path, content, why):
    path = tmp_path / "map.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(TokenMapError, match=why):
        load_token_map(path, 8)


def test_the_mapped_head_scores_the_map_and_floors_the_rest_with_the_same_weights_and_state_dict():
    model = tiny_llama(vocab_size=VOCAB_SIZE, seed=3)
    whole = reference_model(model)
    mapped = mapped_copy(model, MAP)
    assert isinstance(mapped.lm_head, MappedHead) and mapped_size(mapped) == len(MAP) and mapped_size(model) is None
    assert mapped.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(mapped.state_dict()[name], tensor) for name, tensor in model.state_dict().items())
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        expected, got = whole(ids).logits[0], reference_model(mapped)(ids).logits[0]
    outside = torch.tensor([i for i in range(VOCAB_SIZE) if i not in MAP])
    torch.testing.assert_close(got[:, MAP], expected[:, MAP], rtol=1e-5, atol=1e-5)
    assert (got[:, outside] == FLOOR).all()
    assert (torch.softmax(got, dim=-1)[:, outside] == 0).all()
    reference_model(mapped).lm_head.for_step(over_map=False)   # a step with a sampled row: the whole head
    with torch.no_grad():
        torch.testing.assert_close(reference_model(mapped)(ids).logits[0], expected, rtol=1e-5, atol=1e-5)


def test_a_head_with_a_bias_adds_the_maps_entries_of_it_and_a_swap_copies_them_again():
    model = tiny_llama(vocab_size=VOCAB_SIZE, seed=5)
    old = model.lm_head
    model.lm_head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        model.lm_head.weight.copy_(old.weight)
        model.lm_head.bias.normal_()
    head = map_lm_head(model, torch.tensor(MAP))
    rows = torch.randn(8, head.in_features)
    for _ in range(2):   # as built, then after new values are loaded into the head
        with torch.no_grad():
            torch.testing.assert_close(head(rows[:1])[:, MAP], (rows[:1] @ head.weight.T + head.bias)[:, MAP])
            torch.testing.assert_close(head(rows)[:, MAP], (rows @ head.weight.T + head.bias)[:, MAP])
            head.bias.add_(1.0)
            head.weight.mul_(0.5)
        remap_heads(model)


def test_a_tied_head_stays_tied_and_a_weight_swap_copies_the_maps_rows_again():
    model = tiny_llama(vocab_size=VOCAB_SIZE, seed=4)
    model.lm_head.weight = model.model.embed_tokens.weight      # tied, as the shipped draft's
    runner = engine_for_model(mapped_copy(model, MAP)).runner
    assert runner.model.lm_head.weight is runner.model.model.embed_tokens.weight
    trained = {name: tensor + 0.05 * torch.randn_like(tensor) for name, tensor in model.state_dict().items()}
    runner.load_weights(trained)
    head = runner.model.lm_head
    torch.testing.assert_close(head.mapped_weight, trained["lm_head.weight"][MAP])
    rows = torch.randn(8, head.in_features)   # several rows: the packed copy's product, on the CPU
    with torch.no_grad():
        torch.testing.assert_close(head(rows)[:, MAP], rows @ trained["lm_head.weight"][MAP].T, rtol=1e-5, atol=1e-5)


def test_the_whole_head_and_the_maps_rows_each_read_their_own_packed_copy_for_several_rows():
    """On the CPU a product of several rows reads a packed copy (decoding.weight_layout): the whole
    head's is its weight's, the map's its rows'. Weights changed without a repack leave both copies
    stale, which several rows show in either mode and one row in neither."""
    runner = engine_for_model(mapped_copy(tiny_llama(vocab_size=VOCAB_SIZE, seed=6), MAP)).runner
    head = runner.model.lm_head
    with torch.no_grad():
        head.weight.mul_(0.5)
        head.mapped_weight.mul_(0.5)
    one, several = torch.randn(1, head.in_features), torch.randn(8, head.in_features)
    for over_map, columns in ((True, MAP), (False, list(range(VOCAB_SIZE)))):
        head.for_step(over_map)
        with torch.no_grad():
            fresh = lambda rows: (rows @ head.weight.T)[:, columns]  # noqa: E731
            torch.testing.assert_close(head(one)[:, columns], fresh(one), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(head(several)[:, columns], 2 * fresh(several), rtol=1e-4, atol=1e-4)


def test_greedy_speculation_over_a_map_is_target_only_greedy():
    target, draft = tiny_llama(vocab_size=96, seed=0), tiny_llama(vocab_size=96, seed=1)
    proposer = DraftModelProposer(engine_for_model(mapped_copy(draft, list(range(0, 96, 3)))))
    target_engine = engine_for_model(target)
    for index, prompt in enumerate(([5, 17, 42, 8], [60, 2, 33], [11] * 6)):
        params = SamplingParams(temperature=0.0, max_tokens=40)
        alone = RequestState(f"alone{index}", prompt, params, None, max_context=96)
        list(generate(target_engine, alone, None, 0))
        drafted = RequestState(f"drafted{index}", prompt, params, None, max_context=96)
        list(generate(target_engine, drafted, proposer, 4))
        assert drafted.output_ids == alone.output_ids
        assert drafted.stats.num_drafted > 0


def proposed_tokens(proposer, temperature: float, count: int = 200) -> list[list[int]]:
    """count proposals of 4 tokens, each alone in its steps: sampled from PROMPT with seeds, or
    greedy from PROMPT followed by one token of each id."""
    proposals = []
    for index in range(count):
        history = PROMPT if temperature else PROMPT + [index % VOCAB_SIZE]
        params = SamplingParams(temperature=temperature, max_tokens=8, seed=index)
        proposals.append(proposer.propose(f"s{index}", history, 4, params,
                                          torch.Generator().manual_seed(index)).token_ids)
        proposer.release(f"s{index}")
    return proposals


def test_a_mapped_draft_proposes_only_the_maps_tokens_greedy_and_sampled_ones_only_where_asked():
    draft = tiny_llama(vocab_size=VOCAB_SIZE, seed=1)
    whole, mapped, mapped_sampled = (DraftModelProposer(engine_for_model(model)) for model in (
        draft, mapped_copy(draft, MAP), mapped_copy(draft, MAP, maps_sampled=True)))
    outside = lambda proposals: {token for proposal in proposals for token in proposal} - set(MAP)  # noqa: E731
    assert outside(proposed_tokens(whole, 0.0)) and outside(proposed_tokens(whole, 1.0))   # the check can fail
    assert not outside(proposed_tokens(mapped, 0.0))
    assert proposed_tokens(mapped, 1.0) == proposed_tokens(whole, 1.0)   # sampled: the whole head, same draws
    sampled_over_map = proposed_tokens(mapped_sampled, 1.0)
    assert not outside(sampled_over_map) and len({token for proposal in sampled_over_map for token in proposal}) > 4


def test_a_step_mixing_greedy_and_sampled_rows_scores_the_whole_head():
    draft = tiny_llama(vocab_size=VOCAB_SIZE, seed=1)
    whole, mapped = DraftModelProposer(engine_for_model(draft)), DraftModelProposer(engine_for_model(mapped_copy(draft, MAP)))
    greedy = SamplingParams(temperature=0.0)
    for token in range(VOCAB_SIZE):   # a history whose greedy draft over the whole head leaves the map
        history = PROMPT + [token]
        expected = whole.propose("probe", history, 4, greedy).token_ids
        whole.release("probe")
        if set(expected) - set(MAP):
            break
    else:
        pytest.fail("no greedy draft of the whole head leaves the map: the test could not fail")
    assert set(mapped.propose("alone", history, 4, greedy).token_ids) <= set(MAP)
    mixed = mapped.propose_batch([ProposeCall("g", history, 4, greedy),
                                  ProposeCall("s", PROMPT, 4, SamplingParams(temperature=1.0, seed=3),
                                              torch.Generator().manual_seed(3))])
    assert mixed[0].token_ids == expected


def test_sampled_speculation_over_a_map_follows_the_target_and_the_test_rejects_the_drafts_marginal():
    outside = [i for i in range(VOCAB_SIZE) if i not in MAP]

    def the_target_wants_what_the_draft_cannot_give(marginals):
        assert float(marginals["target"][0][outside].sum()) > 0.2

    assert_speculation_follows_the_target(tiny_llama(vocab_size=VOCAB_SIZE, seed=0),
                                          mapped_copy(tiny_llama(vocab_size=VOCAB_SIZE, seed=1), MAP, maps_sampled=True),
                                          NUM_REQUESTS,
                                          seed=2027, check=the_target_wants_what_the_draft_cannot_give)


def test_a_runner_built_from_a_spec_with_a_map_serves_the_mapped_head(tmp_path):
    _, draft_dir = make_tiny_pair(tmp_path)
    (tmp_path / "map.json").write_text(json.dumps([0, 1, 2, 5, 9]))
    spec = {"path": str(draft_dir), "dtype": "float32", "device": "cpu", "torch_threads": 1, "max_sequences": 4,
            "token_map": str(tmp_path / "map.json")}
    assert mapped_size(load_runner(spec).model) == 5
    assert not load_runner(spec).model.lm_head.maps_sampled
    assert load_runner({**spec, "token_map_sampled": True}).model.lm_head.maps_sampled
    assert mapped_size(load_runner({**spec, "token_map": None}).model) is None


def config_from_flags(*flags: str) -> SpecServeConfig:
    """The config the command line's model flags give (cluster.cli.config_from_args)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    add_model_args(parser)
    return config_from_args(parser.parse_args(list(flags)))


def test_the_config_takes_a_map_on_a_draft_model_only_and_a_bad_one_stops_the_start(tmp_path):
    target_dir, draft_dir = make_tiny_pair(tmp_path)
    good, bad = tmp_path / "map.json", tmp_path / "bad.json"
    good.write_text(json.dumps([0, 1, 2]))
    bad.write_text(json.dumps([0, 10 ** 6]))
    config = config_from_flags("--target", str(target_dir), "--draft", str(draft_dir), "--token-map", str(good))
    assert config.draft.token_map == str(good) and str(good) in draft_line(config)
    check_model_paths(config)
    with pytest.raises(TokenMapError, match="outside the draft's vocabulary"):
        check_model_paths(config.model_copy(update={"draft": config.draft.model_copy(update={"token_map": str(bad)})}))
    base = config.model_dump()
    with pytest.raises(ValueError, match="target.token_map"):
        SpecServeConfig.model_validate({**base, "target": {**base["target"], "token_map": str(good)}})
    with pytest.raises(ValueError, match="needs a draft model"):
        SpecServeConfig.model_validate({**base, "speculation": {**base["speculation"], "proposer": "ngram"}})
    with pytest.raises(ValueError, match="draft.token_map is null"):
        SpecServeConfig.model_validate({**base, "draft": {**base["draft"], "token_map": None, "token_map_sampled": True}})
    with pytest.raises(ValueError, match="target.token_map"):
        SpecServeConfig.model_validate({**base, "target": {**base["target"], "token_map_sampled": True}})


def test_a_draft_folders_own_map_serves_by_default_where_it_drafts_as_a_draft_model_on_one_rank(tmp_path):
    default = SpecServeConfig()
    assert default.draft.token_map == AUTO_TOKEN_MAP and not default.draft.token_map_sampled
    assert default.draft_token_map == str(Path(default.draft.path) / FOLDER_TOKEN_MAP)
    check_model_paths(default)   # the shipped map fits the shipped draft
    target_spec, draft_spec = served_model_specs(default)
    assert draft_spec["token_map"] == default.draft_token_map and target_spec["token_map"] is None
    base = default.model_dump()
    for elsewhere in ({"speculation": {**base["speculation"], "proposer": "none"}},
                      {"draft_workers": {**base["draft_workers"], "tensor_parallel_size": 2}}):
        assert SpecServeConfig.model_validate({**base, **elsewhere}).draft_token_map is None
    target_dir, draft_dir = make_tiny_pair(tmp_path)
    config = config_from_flags("--target", str(target_dir), "--draft", str(draft_dir))
    assert config.draft.token_map == AUTO_TOKEN_MAP and config.draft_token_map is None   # its folder has none
    (draft_dir / FOLDER_TOKEN_MAP).write_text(json.dumps([0, 1, 2]))
    assert config.draft_token_map == str(draft_dir / FOLDER_TOKEN_MAP) and FOLDER_TOKEN_MAP in draft_line(config)
    spec = {"path": str(draft_dir), "dtype": "float32", "device": "cpu", "torch_threads": 1, "max_sequences": 4}
    assert mapped_size(load_runner({**spec, "token_map": AUTO_TOKEN_MAP}).model) == 3
    assert mapped_size(load_runner({**spec, "token_map": None}).model) is None


def test_a_map_written_from_a_corpus_holds_its_most_frequent_tokens_and_eos(tmp_path):
    from transformers import AutoTokenizer

    from tests.tiny_pair import TOKENIZER_DIR

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR, local_files_only=True)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.py").write_text("def f(x):\n    return x + 1\n" * 50)
    (tmp_path / "b.txt").write_text("return return return")
    texts = corpus_texts([str(tmp_path / "corpus"), str(tmp_path / "b.txt")])
    assert len(texts) == 2
    ids = token_map(tokenizer, texts, 4)
    assert ids == sorted(ids) and tokenizer.eos_token_id in ids and len(ids) in (4, 5)
    counts = Counter(token for text in texts for token in tokenizer.encode(text, add_special_tokens=False))
    (most, _), (least, _) = counts.most_common()[0], counts.most_common()[-1]
    assert most in ids and least not in ids
    with pytest.raises(ValueError, match="--size"):
        token_map(tokenizer, texts, 0)


def test_the_ranked_map_a_draft_folder_carries_is_what_auto_serves(tmp_path):
    """ranked_tokens ranks a token stream (`specserve train-default` writes the default pair's map
    so, from its training split) and write_folder_map saves it where `draft.token_map: auto` looks."""
    from specserve.decoding.token_map import folder_token_map, ranked_tokens, write_folder_map

    stream = torch.tensor([5, 5, 5, 3, 3, 9, 1, 5, 3, 7])
    assert ranked_tokens(stream, 2, 12, eos_token_id=None) == [3, 5]
    assert ranked_tokens(stream, 2, 12, eos_token_id=11) == [3, 5, 11]
    with pytest.raises(ValueError, match="between 1 and the vocabulary's 12"):
        ranked_tokens(stream, 13, 12, eos_token_id=None)
    path = write_folder_map(tmp_path, [3, 5, 11])
    assert folder_token_map(tmp_path) == str(path) and load_token_map(path, 12).tolist() == [3, 5, 11]
