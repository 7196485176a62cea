"""docs/configuration.md is generated from the schema; a field added, renamed or re-defaulted without
regenerating it fails here."""

from pathlib import Path

from specserve.common.config_doc import render, type_name

CONFIGURATION_MD = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
REGENERATE = "python -m specserve.common.config_doc > docs/configuration.md"


def test_the_committed_configuration_reference_is_current():
    assert CONFIGURATION_MD.read_text() == render(), f"docs/configuration.md is stale: run `{REGENERATE}`"


def test_every_section_and_field_of_the_schema_is_rendered_with_its_env_var():
    text = render()
    for line in ("## `speculation`", "## `draft` (may be `null`)", "`SPECSERVE__SPECULATION__NUM_DRAFT_TOKENS`",
                 "`SPECSERVE__MODEL_NAME`", "`SPECSERVE__TARGET_WORKERS__MAX_REPLICAS`"):
        assert line in text


def test_defaults_are_the_configs_own_per_section_and_hold_no_machine_path():
    text = render()
    ingress = text.split("## `ingress`")[1].split("## ")[0]
    assert "| `num_cpus` | `float` | `0.25` |" in ingress  # SpecServeConfig's default, not WorkerResources'
    assert str(CONFIGURATION_MD.parents[1]) not in text and '"<repo>/models/default/target"' in text


def test_types_are_spelled_short():
    from typing import Literal

    assert type_name(int | None) == "int | None"
    assert type_name(Literal["a", "b"]) == '"a" | "b"'
    assert type_name(dict[str, float]) == "dict[str, float]"
