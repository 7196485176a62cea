"""The config object: defaults, YAML + env loading, validation at the edge."""

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from specserve.common.config import SpecServeConfig, env_overrides, load_config


def test_defaults_point_at_the_shipped_pair():
    config = SpecServeConfig()
    assert config.target.path.endswith("models/default/target")
    assert config.draft is not None and config.draft.path.endswith("models/default/draft")
    assert config.resolved_tokenizer_path == config.target.path


def test_the_default_draft_width_is_the_shipped_pairs_whole_row():
    """Cut to fewer tokens, the shipped draft's q loses a share of its mass that costs sampled
    requests a third of their accepted drafts (docs/sampling.md#how-wide-the-drafts-q-is)."""
    config = SpecServeConfig()
    vocab_size = json.loads((Path(config.draft.path) / "config.json").read_text())["vocab_size"]
    assert config.speculation.draft_top_k >= vocab_size


def test_yaml_file_then_env_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("speculation:\n  num_draft_tokens: 3\n  adaptive: false\nmodel_name: mine\n")
    config = load_config(path, environ={"SPECSERVE__SPECULATION__NUM_DRAFT_TOKENS": "5",
                                        "SPECSERVE__TARGET_WORKERS__NUM_REPLICAS": "2", "OTHER": "x"})
    assert config.model_name == "mine"
    assert config.speculation.num_draft_tokens == 5
    assert config.speculation.adaptive is False
    assert config.target_workers.num_replicas == 2


def test_env_values_keep_their_types():
    assert env_overrides({"SPECSERVE__SPECULATION__ADAPTIVE": "false"}) == {"speculation": {"adaptive": False}}


@pytest.mark.parametrize("bad", [
    {"speculation": {"num_draft_tokens": 9, "max_draft_tokens": 8}},
    {"speculation": {"proposer": "magic"}},
    {"target_workers": {"num_replicas": 0}},
    {"unknown_section": {}},
    {"draft": None},
])
def test_invalid_config_is_rejected(bad):
    with pytest.raises(ValidationError):
        SpecServeConfig.model_validate(bad)


@pytest.mark.parametrize("device", ["cuda:1", "cuda:3"])
def test_a_cuda_index_other_than_0_is_refused_as_ray_shows_each_engine_one_gpu(device):
    with pytest.raises(ValidationError, match=f"device '{device}'.*shows it as cuda:0"):
        SpecServeConfig.model_validate({"target": {"path": "t", "device": device}, "target_workers": {"num_gpus": 1}})


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "auto"])
def test_bare_cuda_and_cuda_0_are_accepted(device):
    config = SpecServeConfig.model_validate({"target": {"path": "t", "device": device}, "target_workers": {"num_gpus": 1}})
    assert config.target.device == device


def test_ngram_needs_no_draft_model():
    config = SpecServeConfig.model_validate({"draft": None, "speculation": {"proposer": "ngram"}})
    assert config.uses_draft_workers


def test_non_mapping_yaml_is_a_clear_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("- a list\n")
    with pytest.raises(ValueError, match="mapping"):
        load_config(path, environ={})
