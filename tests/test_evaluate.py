"""The pair evaluation (training/evaluate.py) on a tiny random pair: its prompts, the evaluation
JSON, and the model card (training/model_card.py), including the shipped card re-rendered."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from specserve.common.config import DEFAULT_MODELS_DIR
from tests.tiny_pair import make_tiny_pair
from specserve.training.evaluate import CARD_COMMAND, evaluate_pair, load_training, main, render_card
from specserve.training.held_out import held_out_corpus
from specserve.training.prompts import load_prompt_set, select_prompts

FAKE_TRAINING = {
    "config": {"vocab_size": 8192, "seq_len": 64, "max_position_embeddings": 256, "batch_size": 2,
               "joint_steps": 7, "distill_steps": 3, "target_lr": 1e-3, "draft_lr": 2e-3,
               "warmup_steps": 1, "seed": 0},
    "target_params": 1, "draft_params": 1, "train_tokens": 123_456, "held_out_tokens": 7_890,
    "tokens_seen": 1_280, "held_out_loss": {"target": 5.4321, "draft": 6.5432},
    "held_out_perplexity": {"target": math.exp(5.4321), "draft": math.exp(6.5432)},
    "device": "cpu", "torch_threads": 1, "train_seconds": 4321.0,
    "log": [{"step": 10, "target_loss": 7.25, "draft_kl": 1.5}],
}
SMALL = ["--num-prompts", "2", "--max-tokens", "8", "--latency-steps", "3", "--loss-windows", "1",
         "--sample-tokens", "6"]


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    make_tiny_pair(root)
    (root / "training.json").write_text(json.dumps(FAKE_TRAINING))
    evaluation = main(["--models", str(root), *SMALL, "--card"])
    return root, evaluation


def test_evaluation_uses_the_benchmarks_prompt_set(evaluated):
    _, evaluation = evaluated
    expected = select_prompts(load_prompt_set("v2").prompts, 2)
    assert [p["prompt_id"] for p in evaluation["prompts"]] == [p.prompt_id for p in expected]
    assert [p["text"] for p in evaluation["prompts"]] == [p.text for p in expected]
    assert evaluation["settings"]["prompt_set"]["name"] == "v2"
    assert evaluation["settings"]["prompt_set"]["path"] == "bench/prompts_v2.json"


def test_evaluation_json_has_the_measurements(evaluated):
    root, evaluation = evaluated
    on_disk = json.loads((root / "evaluation.json").read_text())
    assert on_disk["greedy"] == evaluation["greedy"]
    assert set(evaluation["greedy"]) == {"k4", "k8"}
    for run in [*evaluation["greedy"].values(), evaluation["sampled"]]:
        assert 0.0 <= run["acceptance_rate"] <= 1.0
        assert 0.0 <= run["conditional_acceptance"] <= 1.0
        assert run["mean_tokens_per_pass"] >= 1.0
        assert run["num_accepted"] <= run["num_drafted"]
        assert run["acceptance_rate"] <= run["alpha"] <= 1.0  # accepted/drafted understates alpha
    for run in evaluation["greedy"].values():  # speculative greedy is lossless
        assert run["outputs_identical_to_target_greedy"] == run["num_prompts"] == 2
    assert evaluation["sampled"]["temperature"] == 0.8
    assert 0.0 <= evaluation["greedy_agreement"]["rate"] <= 1.0
    latency = evaluation["latency"]
    assert latency["context"] == 128 and latency["threads"] == 1
    assert latency["target"]["median_ms"] > 0 and latency["draft"]["median_ms"] > 0
    assert evaluation["held_out"]["from_training"]["target"]["loss"] == 5.4321
    assert evaluation["held_out"]["recomputed"]["target"]["windows"] == 1
    assert [s["name"] for s in evaluation["samples"]] == ["fibonacci", "stack", "held-out"]
    assert evaluation["samples"][0]["prompt"] == "def fibonacci(n):"
    assert evaluation["criterion"]["threshold"] == 0.6
    assert len(evaluation["prompts"]) == 2
    assert evaluation["corpus"]["held_out_files"] == len(held_out_corpus())


def test_draft_identical_to_target_is_always_accepted(tmp_path):
    target, draft = make_tiny_pair(tmp_path)
    shutil.rmtree(draft)
    shutil.copytree(target, draft)
    evaluation = evaluate_pair(tmp_path, num_prompts=2, max_tokens=10, ks=(4,), latency_steps=2,
                               loss_windows=0, sample_tokens=2, log=lambda message: None)
    assert evaluation["greedy"]["k4"]["acceptance_rate"] == 1.0
    assert evaluation["greedy"]["k4"]["num_drafted"] > 0
    assert evaluation["greedy_agreement"]["rate"] == 1.0
    assert evaluation["sampled"]["acceptance_rate"] > 0.95
    assert evaluation["held_out"] == {"from_training": None, "recomputed": None}


def test_card_without_training_json_says_the_numbers_are_preliminary(evaluated):
    _, evaluation = evaluated
    card = render_card(evaluation, None)
    assert "**Preliminary numbers**: there was no `training.json`" in card
    assert f"**{evaluation['greedy']['k4']['acceptance_rate']:.3f}**" in card


def test_third_party_prompts_are_selectable_and_named_in_the_card(tmp_path):
    make_tiny_pair(tmp_path)
    evaluation = evaluate_pair(tmp_path, num_prompts=1, prompts="thirdparty", max_tokens=4, ks=(4,),
                               latency_steps=2, loss_windows=0, sample_tokens=2, log=lambda message: None)
    assert evaluation["prompts"][0]["prompt_id"] == "thirdparty-00"
    assert evaluation["settings"]["prompt_set"]["name"] == "thirdparty"
    assert "prompt set `thirdparty` v1" in render_card(evaluation, None)


def test_the_shipped_card_re_renders_byte_identical_from_its_evaluation_json():
    """The card of models/default predates prompt sets (line-chunk prompts): still rendered as shipped."""
    evaluation = json.loads((DEFAULT_MODELS_DIR / "evaluation.json").read_text())
    card = render_card(evaluation, load_training(DEFAULT_MODELS_DIR))
    assert card == (DEFAULT_MODELS_DIR / "README.md").read_text()


def test_card_renders_the_numbers(evaluated):
    root, evaluation = evaluated
    card = (root / "README.md").read_text()
    assert "prompt set `v2` v2" in card and "(`bench/prompts_v2.json`, shared with `specserve bench`)" in card
    k4 = evaluation["greedy"]["k4"]
    assert f"**{k4['acceptance_rate']:.3f}**" in card
    assert f"{evaluation['greedy']['k8']['mean_tokens_per_pass']:.2f}" in card
    assert f"{evaluation['latency']['target']['median_ms']:.2f} ms" in card
    assert "5.432 / 228.63" in card  # held-out loss / perplexity from training.json
    assert "1,280" in card and "123,456" in card and "1 h 12 min" in card
    assert CARD_COMMAND in card
    assert "def fibonacci(n):" in card and "class Stack:" in card
    # --card-only re-renders from evaluation.json without evaluating again.
    (root / "README.md").unlink()
    main(["--models", str(root), "--card-only"])
    assert (root / "README.md").read_text() == card


def test_card_describes_the_on_policy_distillation(evaluated):
    _, evaluation = evaluated
    assert "On-policy distillation" not in render_card(evaluation, FAKE_TRAINING)
    distilled = dict(FAKE_TRAINING, draft_distillation={
        "config": {"steps": 4000, "prompt_tokens": 64, "new_tokens": 128, "greedy_sequences": 3072,
                   "sampled_sequences": 1536, "temperature": 0.8, "corpus_every": 3, "batch_size": 8,
                   "lr": 1e-3},
        "tokens_seen": 6_112_000, "held_out_greedy_agreement": {"before": 0.6431, "after": 0.8123},
        "train_seconds": 3000, "hardware": "x86_64, 2 CPU cores", "torch_threads": 2})
    card = render_card(evaluation, distilled)
    assert "3. **On-policy distillation**, 4,000 steps" in card
    assert "0.643 before, 0.812 after" in card and "6,112,000 tokens" in card
