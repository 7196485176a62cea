"""The benchmark's fixed parts: the versioned prompt set, the performance-model math, the row
summary, the report renderer, and one in-process smoke run on a tiny random pair (no Ray)."""

import json
import sys
from pathlib import Path

import pytest

from specserve.bench.http_rows import http_configs, request_body, sweep_request_count
from specserve.bench.perfmodel import (
    expected_tokens_per_pass,
    overlapped_speedup_bound,
    percentile,
    ratio,
    serial_speedup_estimate,
)
from specserve.bench.records import RequestRecord, StepLatency, summarize_row
from specserve.bench.report import render_markdown, write_outputs
from specserve.common.config import SpecServeConfig
from specserve.policies.acceptance import acceptance_from_tokens_per_round
from specserve.training.corpus import is_held_out
from specserve.training.prompts import (
    DEFAULT_PROMPTS_PATH,
    MAX_CODE_CHARS,
    MIN_CODE_CHARS,
    PROMPT_SETS,
    load_prompt_set,
    select_prompts,
)


# -- prompt set -------------------------------------------------------------------------------------

def test_prompt_set_is_versioned_and_mixes_code_and_prose():
    prompt_set = load_prompt_set()
    version, prompts = prompt_set.version, prompt_set.prompts
    assert prompt_set.name == "v2" and version == 2 and DEFAULT_PROMPTS_PATH.name == "prompts_v2.json"
    kinds = [p.kind for p in prompts]
    assert kinds.count("code") >= 10 and kinds.count("prose") >= 3
    assert len({p.prompt_id for p in prompts}) == len(prompts)
    assert all(p.text.strip() for p in prompts)


def test_code_prompts_come_from_distinct_held_out_files():
    prompts = load_prompt_set("v2").prompts
    files = [p.source.split(":")[0] for p in prompts if p.kind == "code"]
    assert len(set(files)) == len(files)
    assert all(is_held_out(path) for path in files)
    assert all(MIN_CODE_CHARS <= len(p.text) <= MAX_CODE_CHARS for p in prompts if p.kind == "code")


def test_prompt_set_regenerates_identically_on_the_interpreter_that_made_it():
    recorded = json.loads(DEFAULT_PROMPTS_PATH.read_text())
    if recorded["generated_with_python"] != sys.version.split()[0]:
        pytest.skip("the stdlib (and so the held-out corpus) differs from the one the set was built from")
    from specserve.training.prompts import build_prompt_set

    assert build_prompt_set() == recorded


def test_a_small_selection_keeps_code_and_prose():
    prompts = load_prompt_set().prompts
    chosen = select_prompts(prompts, 4)
    assert len(chosen) == 4 and {p.kind for p in chosen} == {"code", "prose"}
    assert select_prompts(prompts, None) == prompts


THIRD_PARTY_MARKERS = ("fastapi", "pandas", "optimizer.zero_grad", "click", "@dataclass", "def where", "aiohttp",
                       "pytest", "django", "numpy", "schema", "pygame")


def test_third_party_set_is_versioned_code_unlike_the_training_corpus():
    prompt_set = load_prompt_set("thirdparty")
    assert prompt_set.path == PROMPT_SETS["thirdparty"] and prompt_set.path.name == "prompts_thirdparty_v1.json"
    assert prompt_set.version == 1 and len(prompt_set.prompts) == 12
    assert all(p.kind == "code" and 150 <= len(p.text) <= 400 for p in prompt_set.prompts)
    assert len({p.prompt_id for p in prompt_set.prompts}) == 12
    texts = [p.text.lower() for p in prompt_set.prompts]
    # One prompt per third-party style, none of them stdlib code from the corpus.
    assert all(any(marker in text for text in texts) for marker in THIRD_PARTY_MARKERS)
    assert all(not p.source.endswith(".py") for p in prompt_set.prompts)


def test_a_prompt_set_is_chosen_by_name_or_path_and_unknown_names_are_refused():
    by_path = load_prompt_set(str(PROMPT_SETS["thirdparty"]))
    assert by_path.name == "thirdparty" and by_path.prompts == load_prompt_set("thirdparty").prompts
    assert load_prompt_set("v2").describe()["path"] == "bench/prompts_v2.json"
    with pytest.raises(ValueError, match="thirdparty"):
        load_prompt_set("nope")


# -- performance model --------------------------------------------------------------------------------

def test_expected_tokens_per_pass_matches_the_geometric_series():
    assert expected_tokens_per_pass(0.8, 4) == pytest.approx(1 + 0.8 + 0.64 + 0.512 + 0.4096)
    assert expected_tokens_per_pass(0.0, 4) == 1.0
    assert expected_tokens_per_pass(1.0, 4) == 5.0
    with pytest.raises(ValueError):
        expected_tokens_per_pass(1.5, 4)


def test_bound_and_serial_estimate_on_known_numbers():
    e = 3.3616  # alpha 0.8, K 4
    assert overlapped_speedup_bound(0.8, 4, 0.010, 0.0125) == pytest.approx(e * 0.010 / 0.0125)
    # K * t_draft + t(K+1) = 4 * 2 ms + 12.5 ms
    assert serial_speedup_estimate(0.8, 4, 0.010, 0.0125, 0.002) == pytest.approx(e * 0.010 / 0.0205)


def test_acceptance_fit_inverts_expected_tokens_per_pass():
    for alpha, depth in ((0.3, 4), (0.7, 4), (0.9, 2.5)):
        assert acceptance_from_tokens_per_round(expected_tokens_per_pass(alpha, depth), depth) == pytest.approx(alpha)
    assert acceptance_from_tokens_per_round(1.0, 4) == 0.0
    assert acceptance_from_tokens_per_round(5.0, 4) == 1.0


def test_ratio_and_percentile_handle_missing_values():
    assert ratio(30.0, 12.0) == 2.5
    assert ratio(None, 12.0) is None and ratio(3.0, 0.0) is None
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10, 20], 95) == pytest.approx(19.5)
    assert percentile([], 50) is None


# -- row summary --------------------------------------------------------------------------------------

def record(run: int, tokens: int, wall_s: float, ttft_s: float, drafted: int = 0, accepted: int = 0,
           rounds: int = 0, passes: int | None = None, overhead_s: float | None = 0.001) -> RequestRecord:
    return RequestRecord(prompt_id=f"p{run}", run=run, num_prompt_tokens=10, num_output_tokens=tokens,
                         wall_s=wall_s, ttft_s=ttft_s, target_passes=passes if passes is not None else tokens,
                         rounds=rounds, num_drafted=drafted, num_accepted=accepted, median_overhead_s=overhead_s)


STEPS = StepLatency(target_s={1: 0.010, 5: 0.0125}, draft_s=0.002)


def test_tokens_per_s_is_the_median_over_runs():
    records = [record(0, 100, 1.0, 0.1), record(1, 100, 2.0, 0.1), record(2, 100, 4.0, 0.1)]
    summary = summarize_row(records, STEPS)
    assert summary["tokens_per_s_runs"] == [100.0, 50.0, 25.0]
    assert summary["tokens_per_s"] == 50.0
    assert summary["tpot_ms"] == pytest.approx(1000 * (2.0 - 0.1) / 99)


def test_target_only_rows_have_bound_one_and_no_acceptance():
    summary = summarize_row([record(0, 10, 1.0, 0.1)], STEPS)
    assert summary["acceptance_rate"] is None and summary["bound"] == 1.0 and summary["tokens_per_pass"] == 1.0


def test_speculative_row_fits_alpha_and_bounds_from_measured_rounds():
    # 10 rounds of K=4 emitting 3 tokens each (2 accepted + 1), plus the prefill pass.
    summary = summarize_row([record(0, 31, 1.0, 0.1, drafted=40, accepted=20, rounds=10, passes=11)], STEPS)
    assert summary["acceptance_rate"] == 0.5 and summary["tokens_per_round"] == 3.0
    assert expected_tokens_per_pass(summary["alpha"], 4) == pytest.approx(3.0)
    assert summary["bound"] == pytest.approx(3.0 * 0.010 / 0.0125)
    assert summary["serial_estimate"] == pytest.approx(3.0 * 0.010 / (4 * 0.002 + 0.0125))


# -- report -------------------------------------------------------------------------------------------

def synthetic_result() -> dict:
    def row(key, transport, k, tokens_per_s, vs_target, overhead, bound):
        return {"key": key, "label": key, "transport": transport, "num_draft_tokens": k, "mean_draft_tokens": k or 0,
                "tokens_per_s": tokens_per_s, "vs_target_only": vs_target, "vs_hf_dynamic": 1.4,
                "vs_hf_constant": None, "ttft_ms": 20.0, "tpot_ms": 5.0, "acceptance_rate": None, "alpha": None,
                "tokens_per_pass": 1.0, "overhead_ms": overhead, "bound": bound, "serial_estimate": None,
                "baseline": "target-http"}

    rows = [row("target-http", "HTTP", 0, 40.0, 1.0, 1.0, 1.0),
            row("specserve-http", "HTTP", 4, 110.0, 2.75, 3.1, 3.0)]
    return {"name": "tiny", "prompt_set": {"version": 1, "num_prompts": 2, "num_code": 1, "num_prose": 1},
            "settings": {"max_tokens": 16, "runs": 1, "target_path": "t", "draft_path": "d", "dtype": "float32",
                         "device": "cpu", "num_draft_tokens": 4, "threads": 1},
            "machine": {"cpu_count": 2, "torch": "x", "transformers": "y"},
            "step_latency": {"context_tokens": 128, "target_ms": {"1": 10.0, "5": 12.5}, "draft_ms": 2.0,
                             "draft_cost_ratio": 0.2},
            "modes": {"greedy": {"rows": rows, "sweep": {"specserve": [
                {"concurrency": 1, "num_requests": 2, "tokens_per_s": 100.0, "latency_p50_ms": 150.0,
                 "latency_p95_ms": 180.0, "ttft_p50_ms": 20.0, "ttft_p95_ms": 25.0, "acceptance_rate": 0.6},
                {"concurrency": 2, "num_requests": 4, "tokens_per_s": 150.0, "latency_p50_ms": 200.0,
                 "latency_p95_ms": 260.0, "ttft_p50_ms": 30.0, "ttft_p95_ms": 45.0, "acceptance_rate": 0.6}]}}},
            "notes": ["a note"]}


def test_markdown_report_has_the_table_targets_and_sweep():
    text = render_markdown(synthetic_result())
    assert "| specserve-http | HTTP | 4 (4.00) | 110.0 | 2.75× | 1.40× | n/a |" in text
    assert "2.75× (target ≥ 2.0×: met)" in text
    assert "3.10 ms (target ≤ 1.5 ms: NOT met)" in text
    assert "| specserve | 2 | 4 | 150.0 |" in text
    assert "- a note" in text


def test_the_performance_doc_states_the_targets_the_report_checks():
    """One set of targets: docs/performance.md's "Targets" section says what bench/report.py checks."""
    from specserve.bench import report

    section = (Path(__file__).resolve().parents[1] / "docs" / "performance.md").read_text().split("## Targets", 1)[1].split("\n## ", 1)[0]
    section = " ".join(section.split())
    assert f"at least {report.SPEEDUP_TARGET_VS_TARGET_ONLY:g}× target-only" in section
    assert f"at least {report.SPEEDUP_TARGET_VS_HF_CONSTANT:g}× HF assisted generation with a constant K" in section
    assert f"at most {report.OVERHEAD_TARGET_MS:g} ms of orchestration overhead" in section


def test_outputs_are_written_with_latest_copies(tmp_path):
    paths = write_outputs(synthetic_result(), tmp_path)
    names = {p.name for p in paths}
    assert {"tiny.json", "tiny.md", "tiny_speedup.png", "tiny_concurrency.png", "latest.json", "latest.md",
            "latest_speedup.png", "latest_concurrency.png"} <= names
    assert json.loads((tmp_path / "latest.json").read_text())["name"] == "tiny"


# -- HTTP request shaping (no Ray started) -----------------------------------------------------------------

def test_http_configs_pin_depth_and_disable_the_proposer_for_the_baseline():
    speculative, target_only = http_configs(SpecServeConfig(), num_draft_tokens=6, adaptive=False, port=12345)
    assert speculative.speculation.proposer == "draft" and not speculative.speculation.adaptive
    assert speculative.speculation.num_draft_tokens == 6 and speculative.speculation.max_draft_tokens >= 6
    assert target_only.speculation.proposer == "none"
    assert speculative.http.port == target_only.http.port == 12345


def test_sampled_requests_are_seeded_and_greedy_ones_are_not():
    assert request_body("m", "p", "greedy", 8, 3)["temperature"] == 0.0
    sampled = request_body("m", "p", "sampled", 8, 3)
    assert sampled["temperature"] == 0.8 and sampled["seed"] == 3 and sampled["stream"]


def test_sweep_request_counts_are_bounded():
    assert sweep_request_count(1, 16, 32) == 16
    assert sweep_request_count(16, 16, 32) == 32
    assert sweep_request_count(16, 4, 20) == 20
    assert sweep_request_count(64, 4, 32) == 64  # never fewer requests than streams


# -- smoke run --------------------------------------------------------------------------------------------

def test_in_process_rows_run_end_to_end_on_a_tiny_pair(tmp_path):
    from specserve.bench.run import main
    from tests.tiny_pair import make_tiny_pair

    target, draft = make_tiny_pair(tmp_path / "pair")
    config = tmp_path / "config.yaml"
    config.write_text(f"target:\n  path: {target}\ndraft:\n  path: {draft}\n")
    result = main(["--config", str(config), "--mode", "greedy", "--max-tokens", "8", "--runs", "1",
                   "--num-prompts", "2", "--rows", "target-inproc,hf-target,hf-dynamic,hf-constant,specserve-inproc",
                   "--out", str(tmp_path / "results"), "--name", "smoke"])
    rows = {row["key"]: row for row in result["modes"]["greedy"]["rows"]}
    assert set(rows) == {"target-inproc", "hf-target", "hf-dynamic", "hf-constant", "specserve-inproc"}
    speculative, baseline = rows["specserve-inproc"], rows["target-inproc"]
    assert speculative["vs_target_only"] == pytest.approx(speculative["tokens_per_s"] / baseline["tokens_per_s"])
    # Greedy speculation is lossless: the very same tokens as target-only, prompt by prompt.
    spec_ids = [(r["prompt_id"], r["output_token_ids"]) for r in speculative["records"]]
    assert spec_ids == [(r["prompt_id"], r["output_token_ids"]) for r in baseline["records"]]
    assert all(len(ids) == 8 for _, ids in spec_ids)
    # HF's own target-only decoding: one pass a token, the target's greedy tokens.
    hf_target = rows["hf-target"]
    assert [(r["prompt_id"], r["output_token_ids"]) for r in hf_target["records"]] == spec_ids
    assert all(r["target_passes"] == r["num_output_tokens"] for r in hf_target["records"])
    assert 0.0 <= rows["hf-constant"]["acceptance_rate"] <= 1.0
    assert rows["specserve-inproc"]["mean_draft_tokens"] > 0
    assert (tmp_path / "results" / "smoke.md").exists() and (tmp_path / "results" / "latest.json").exists()
    assert "## greedy, prompts `v2` v2" in (tmp_path / "results" / "smoke.md").read_text()


def test_the_in_process_clock_counts_an_engines_model_calls_once(tmp_path):
    """The engines' lean forward calls no module's forward, so hooks alone would count none of
    their compute and an in-process row's overhead would be its whole round."""
    import time

    import torch

    from specserve.bench.inprocess import load_pair
    from specserve.decoding.block_manager import ForwardCall
    from tests.tiny_pair import make_tiny_pair

    pair = load_pair(*map(str, make_tiny_pair(tmp_path / "pair")))
    prompt = list(range(3, 40))
    for engine in (pair.target, pair.draft):
        before, started = pair.clock.total_s, time.perf_counter()
        engine.forward_batch([ForwardCall("s", prompt, len(prompt))])
        wall = time.perf_counter() - started
        assert 0.0 < pair.clock.total_s - before <= wall
    before, started = pair.clock.total_s, time.perf_counter()
    pair.target_model(input_ids=torch.tensor([prompt]))   # what Hugging Face's generate calls
    assert 0.0 < pair.clock.total_s - before <= time.perf_counter() - started


def test_outside_overhead_is_the_round_minus_the_engine_time_it_waited_on():
    from specserve.bench.round_profile import outside_overheads

    logs = {"target": [("verify", "a", 0.000, 0.010),            # prefill
                       ("verify", "a", 0.016, 0.030),            # round 1: fresh draft 0.011-0.014
                       ("verify", "a", 0.033, 0.045),            # round 2: block drafted ahead
                       ("verify", "other", 0.100, 0.200)],
            "draft": [("propose", "a", 0.011, 0.014),
                      ("propose", "a", 0.017, 0.028)]}          # ahead: overlaps round 1's verify
    overheads = outside_overheads(logs, {"a"})
    # round 1: 0.020 wall - 0.014 verify - 0.003 draft; round 2: 0.015 - 0.012, the ahead draft not waited on
    assert overheads == pytest.approx([0.003, 0.003])


def test_a_classes_orchestration_is_each_rounds_wall_minus_its_time_in_the_engines():
    from specserve.bench.round_profile import class_summary

    fresh = {"wall": 30.0, "draft_hop_out": 0.5, "draft_loop_wait": 1.0, "draft_compute": 6.0, "draft_hop_back": 0.5,
             "target_hop_out": 0.5, "target_loop_wait": 0.0, "target_compute": 20.0, "target_hop_back": 0.5}
    cached = {"wall": 24.0, "draft_hop_out": 0.5, "draft_loop_wait": 0.0, "draft_compute": 0.0, "draft_hop_back": 0.5,
              "target_hop_out": 0.5, "target_compute": 20.0, "target_hop_back": 0.5}
    record = {"num_output_tokens": 10, "num_drafted": 8, "num_accepted": 6, "round_stages_ms": [fresh, cached],
              "ttft_s": 0.05}
    summary = class_summary([record], 2.0)
    # 30 - 27 and 24 - 20: the hops (2 ms each) and the router's own work
    assert summary["orchestration_median_ms"] == pytest.approx(3.5) and summary["hops_median_ms"] == pytest.approx(2.0)
    assert summary["own_median_ms"] == pytest.approx(1.5)   # 3 - 2 and 4 - 2
    assert summary["tokens_per_s"] == 5.0 and summary["acceptance"] == 0.75 and summary["ttft_median_ms"] == 50.0


def test_the_first_token_splits_into_the_way_in_and_out_and_the_routers_wait():
    from specserve.bench.round_profile import class_summary, first_token_lines

    stages = {"engine_lookup": 4.0, "target_hop_out": 0.5, "target_loop_wait": 1.0, "target_compute": 60.0,
              "target_hop_back": 0.5}
    records = [{"num_output_tokens": 4, "num_drafted": 0, "num_accepted": 0, "ttft_s": client, "server_ttft_s": router,
                "first_token_stages_ms": stages} for client, router in ((0.080, 0.070), (0.090, 0.071))]
    split = class_summary(records, 1.0)["first_token_split_ms"]
    assert split == {"client": 85.0, "outside_router": 14.5, "router": 70.5, "engine_lookup": 4.0, "prefill_hops": 1.0,
                     "prefill_loop_wait": 1.0, "prefill_compute": 60.0}
    assert "| greedy | 85.0 | 14.5 | 70.5 | 4.0 | 1.0 | 1.0 | 60.0 |" in first_token_lines({"greedy": split})
    # without the router's profiled split (the switch off) there is nothing to report
    assert class_summary([{**records[0], "first_token_stages_ms": None}], 1.0)["first_token_split_ms"] is None
    assert first_token_lines({"greedy": None}) == []


def test_combined_sweep_runs_average_each_variant_and_level():
    from specserve.bench.load_sweep import adaptive_against_fixed, combine_runs

    def run(name, adaptive, k4):
        def level(streams, tok_s):
            return {"concurrency": streams, "num_requests": 4, "tokens_per_s": tok_s, "latency_p50_ms": 1.0,
                    "latency_p95_ms": 2.0, "ttft_p50_ms": None, "ttft_p95_ms": None, "acceptance_rate": 0.5,
                    "mean_draft_tokens": 4.0, "records": [{}]}
        return {"name": name, "command": f"specserve bench-load --name {name}", "prompts": "p", "max_tokens": 8,
                "mode": "greedy", "machine": "m",
                "variants": {"adaptive": [level(1, adaptive[0]), level(2, adaptive[1])],
                             "k4": [level(1, k4[0]), level(2, k4[1])]}}

    combined = combine_runs([run("a", (90.0, 100.0), (100.0, 100.0)), run("b", (110.0, 120.0), (100.0, 80.0))], "m")
    assert [level["tokens_per_s"] for level in combined["variants"]["adaptive"]] == [100.0, 110.0]
    assert combined["variants"]["k4"][1]["num_requests"] == 8 and "records" not in combined["variants"]["k4"][0]
    table = adaptive_against_fixed(combined)
    assert [round(row["ratio"], 3) for row in table[:2]] == [1.0, 1.222]


@pytest.mark.ray
@pytest.mark.slow   # in make reliability (about a minute: two apps of one cluster)
def test_interleaved_sweep_serves_every_variant_side_by_side_with_its_own_policy_actor(tmp_path):
    """`bench-load --interleave`: variants as apps of one cluster, each level run in turns; every
    variant answers on its own route and model name, and each app reports to its own policy actor."""
    import ray

    from specserve.bench import load_sweep
    from specserve.policies.actor import POLICY_NAMESPACE
    from specserve.common.naming import policy_actor_name

    seen_actors: list[set[str]] = []
    original = load_sweep.engine_counters

    def counters_and_actors():
        seen_actors.append({entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)
                            if entry["namespace"] == POLICY_NAMESPACE})
        return original()

    load_sweep.engine_counters = counters_and_actors
    try:
        load_sweep.main(["--variants", "k0,k2", "--interleave", "2", "--concurrency", "1", "--num-prompts", "2",
                         "--requests-per-level", "2", "--requests-per-stream", "1", "--max-tokens", "8",
                         "--out", str(tmp_path), "--name", "interleaved"])
    finally:
        load_sweep.engine_counters = original
    result = json.loads((tmp_path / "interleaved.json").read_text())
    assert set(result["variants"]) == {"k0", "k2"}
    for variant, (level,) in result["variants"].items():
        assert level["num_requests"] == 4 and len(level["turns_tokens_per_s"]) == 2
        depth = level["mean_draft_tokens"]
        assert (depth == 0.0) if variant == "k0" else (0.0 < depth <= 2.0)
    names = set().union(*seen_actors)
    assert {policy_actor_name("specserve-default-k0"), policy_actor_name("specserve-default-k2")} <= names


def test_load_sweep_variants_compose_their_suffixes():
    from specserve.bench.load_sweep import variant_config

    config = variant_config(SpecServeConfig(), "k4-plain-2routers-interval50", 4, 8123, null_forward=0.8)
    assert config.router.num_replicas == 2 and config.http.stream_interval_ms == 50.0 and config.http.port == 8123
    assert config.speculation.fan_out == 0 and config.speculation.num_draft_tokens == 4
    assert not config.speculation.adaptive
    assert (config.target.null_forward_agreement, config.draft.null_forward_agreement) == (1.0, 0.8)
    plain = variant_config(SpecServeConfig(), "adaptive", 4, 8123)
    assert plain.router.num_replicas == 1 and plain.http.stream_interval_ms == 0.0
    assert plain.target.null_forward_agreement is None and plain.speculation.adaptive
    assert plain.speculation.fan_out_measured
    unmeasured = variant_config(SpecServeConfig(), "adaptive-unmeasured", 4, 8123)
    assert not unmeasured.speculation.fan_out_measured and unmeasured.speculation.fan_out > 0
    one_step = variant_config(SpecServeConfig(), "target-only-steps1-interval20", 4, 8123)
    assert (one_step.speculation.proposer, one_step.speculation.target_only_steps) == ("none", 1)
    assert one_step.http.stream_interval_ms == 20.0 and plain.speculation.target_only_steps == 4
    wide = variant_config(SpecServeConfig(), "k4-token-topk512-interval20", 4, 8123)
    assert (wide.speculation.draft_top_k, wide.speculation.verification, wide.http.stream_interval_ms) == \
        (512, "token", 20.0)
    assert wide.speculation.draft_top_k != plain.speculation.draft_top_k


def test_load_sweep_refuses_a_variant_whose_base_is_unknown_before_starting_anything(capsys):
    from specserve.bench.load_sweep import main

    for named in ("k5", "k4-tokens", "k4-2routers-token"):   # the last: suffixes out of order
        with pytest.raises(SystemExit):
            main(["--variants", f"k4-token-2routers-steps8-interval50,{named}", "--out", "/nonexistent"])
        assert "unknown variants" in capsys.readouterr().err


class ClusterStarted(Exception):
    """What the spy below raises where a bench would start its cluster."""


def test_the_benches_start_their_cluster_as_specserve_serve_does(monkeypatch):
    """specserve bench's HTTP rows and bench-load start Ray through cluster.local.init_local_ray,
    which brings Serve's data plane (cluster/serve_data_plane.py); a ray.init of their own left it
    out, and every HTTP figure then measured Serve's Python proxy."""
    import specserve.cluster.local as local
    from specserve.bench.http_rows import serving
    from specserve.bench.load_sweep import run_interleaved

    started = []

    def spy(**ray_init_kwargs):
        started.append(ray_init_kwargs)
        raise ClusterStarted

    monkeypatch.setattr(local, "init_local_ray", spy)
    config = SpecServeConfig()
    with pytest.raises(ClusterStarted):
        with serving(config, config):
            pass
    with pytest.raises(ClusterStarted):
        run_interleaved({"k4": config}, None, [1], 1, print, None)
    assert len(started) == 2


def test_round_profile_names_a_process_by_its_actor_not_the_method_it_runs():
    """A Ray worker's title names the method it runs now; the CPU table must not split one
    process into several roles (nor match one reading's role to another process)."""
    from specserve.bench.round_profile import cpu_seconds_between, process_role

    class Titled:
        def __init__(self, title: str) -> None:
            self.title = title

        def cmdline(self) -> list[str]:
            return [self.title]

    assert {process_role(Titled(title)) for title in (
        "ray::ServeReplica:specserve:Router", "ray::ServeReplica:specserve:Router.handle_request_with_rejection")} == {"Router"}
    assert process_role(Titled("ray::PolicyActor.decision")) == "PolicyActor"
    before = {1: ("Router", 10.0), 2: ("PolicyActor", 5.0)}
    after = {1: ("Router", 10.5), 2: ("PolicyActor", 5.25), 3: ("EngineProcess", 1.0)}
    assert cpu_seconds_between(before, after) == {"Router": 0.5, "PolicyActor": 0.25, "EngineProcess": 1.0}


def test_process_cpu_takes_each_process_median_over_turns_counting_a_missing_one_as_idle():
    from specserve.bench.figures.process_cpu import markdown, median_shares

    runs = [{"tokens_per_s": 10.0, "cpu_percent": {"loaded": {"Router": 40.0, "PolicyActor": 30.0}, "idle": {}}},
            {"tokens_per_s": 12.0, "cpu_percent": {"loaded": {"Router": 44.0}, "idle": {"PolicyActor": 2.0}}}]
    assert median_shares(runs, "loaded") == {"Router": 42.0, "PolicyActor": 15.0}
    result = {"name": "n", "command": "c", "streams": 1, "requests": 2, "max_tokens": 3, "idle_s": 4, "turns": 2,
              "trees": {"after": "."}, "runs": {"after": runs},
              "summary": {"after": {"tokens_per_s": 11.0, "loaded": median_shares(runs, "loaded"),
                                    "idle": median_shares(runs, "idle")}}}
    text = markdown(result)
    assert "| Router | 42.0 |" in text and "| all | 57.0 |" in text and "| after | 11.0 (10.0, 12.0) |" in text


def test_channel_hops_times_every_variant_and_writes_its_tables(tmp_path):
    """A short run of the hop-floor bench: every variant timed in every turn, a positive figure each,
    the markdown and json written where asked."""
    import json

    from specserve.bench.figures.channel_hops import main

    result = main(["--calls", "20", "--turns", "2", "--out", str(tmp_path), "--name", "hops"])
    assert len(result["median_us"]) == 6
    assert all(len(turns) == 2 and min(turns) > 0 for turns in result["turns_us"].values())
    assert json.loads((tmp_path / "hops.json").read_text())["median_us"] == result["median_us"]
    table = (tmp_path / "hops.md").read_text()
    assert "| channel round trip, local socket |" in table and "| channel round trip, TCP |" in table
