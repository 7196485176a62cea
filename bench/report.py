"""Turn a benchmark result (the dict run.py builds and saves as JSON) into a markdown table and
PNG plots, and write all of them under the results folder (plus the `latest.*` copies)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# The project's targets for one stream over HTTP (docs/performance.md, "Targets", states the same).
SPEEDUP_TARGET_VS_TARGET_ONLY = 2.0
SPEEDUP_TARGET_VS_HF_CONSTANT = 1.3
OVERHEAD_TARGET_MS = 1.5

TABLE_COLUMNS = ["row", "transport", "K (mean)", "tok/s", "× target-only", "× HF dynamic", "× HF const K",
                 "TTFT ms", "TPOT ms", "accept", "α", "tok/pass", "overhead ms/round",
                 "bound E·t(1)/t(K+1)", "serial est."]


def _fmt(value, digits: int = 2, suffix: str = "") -> str:
    if value is None:
        return "n/a"
    return f"{value:.{digits}f}{suffix}"


def _row_cells(row: dict) -> list[str]:
    k = row["num_draft_tokens"]
    depth = "0" if k == 0 else f"{'dyn' if k is None else k} ({row['mean_draft_tokens']:.2f})"
    return [row["label"], row["transport"], depth, _fmt(row["tokens_per_s"], 1),
            _fmt(row["vs_target_only"], 2, "×"), _fmt(row["vs_hf_dynamic"], 2, "×"),
            _fmt(row["vs_hf_constant"], 2, "×"), _fmt(row["ttft_ms"], 1), _fmt(row["tpot_ms"], 2),
            _fmt(row["acceptance_rate"], 3), _fmt(row["alpha"], 3), _fmt(row["tokens_per_pass"], 2),
            _fmt(row["overhead_ms"], 2), _fmt(row["bound"], 2, "×"), _fmt(row["serial_estimate"], 2, "×")]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def _target_lines(mode_result: dict) -> list[str]:
    """The project's targets, checked against this run's numbers (measured, not asserted)."""
    rows = {row["key"]: row for row in mode_result["rows"]}
    http = rows.get("specserve-http")
    if http is None:
        return ["- targets: n/a (no single-stream HTTP row in this run)"]

    def verdict(value, ok) -> str:
        return "n/a" if value is None else ("met" if ok(value) else "NOT met")

    lines = []
    vs_target = http["vs_target_only"]
    lines.append(f"- single stream over HTTP vs target-only ({http['baseline']}): {_fmt(vs_target, 2, '×')} "
                 f"(target ≥ {SPEEDUP_TARGET_VS_TARGET_ONLY}×: "
                 f"{verdict(vs_target, lambda v: v >= SPEEDUP_TARGET_VS_TARGET_ONLY)})")
    met = verdict(http["vs_hf_constant"], lambda v: v >= SPEEDUP_TARGET_VS_HF_CONSTANT)
    lines.append(f"- single stream over HTTP vs HF assisted, constant K: {_fmt(http['vs_hf_constant'], 2, '×')} "
                 f"(target ≥ {SPEEDUP_TARGET_VS_HF_CONSTANT}×: {met})")
    overhead = http["overhead_ms"]
    lines.append(f"- orchestration overhead per round over HTTP (median): {_fmt(overhead, 2, ' ms')} "
                 f"(target ≤ {OVERHEAD_TARGET_MS} ms: {verdict(overhead, lambda v: v <= OVERHEAD_TARGET_MS)})")
    return lines


def _sweep_section(sweeps: dict[str, list[dict]]) -> list[str]:
    header = ["app", "streams", "requests", "tok/s", "p50 latency ms", "p95 latency ms", "p50 TTFT ms",
              "p95 TTFT ms", "accept"]
    cells = [[app, str(level["concurrency"]), str(level["num_requests"]), _fmt(level["tokens_per_s"], 1),
              _fmt(level["latency_p50_ms"], 0), _fmt(level["latency_p95_ms"], 0), _fmt(level["ttft_p50_ms"], 0),
              _fmt(level["ttft_p95_ms"], 0), _fmt(level["acceptance_rate"], 3)]
             for app, levels in sweeps.items() for level in levels]
    return ["", "Concurrency sweep over HTTP (loopback; tok/s = all output tokens / wall time of the level):", "",
            markdown_table(header, cells)]


def _prompt_set_line(prompt_set: dict) -> str:
    """Which prompts a table measured. Results written before named prompt sets carry no name."""
    if "name" not in prompt_set:
        return (f"set v{prompt_set['version']}, {prompt_set['num_prompts']} prompts ({prompt_set['num_code']} "
                f"code from held-out stdlib files, {prompt_set['num_prose']} prose)")
    return (f"set `{prompt_set['name']}` v{prompt_set['version']} (`{prompt_set['path']}`), "
            f"{prompt_set['num_prompts']} prompts ({prompt_set['num_code']} code, {prompt_set['num_prose']} prose): "
            f"{prompt_set['description']}")


def _prompt_set_tag(prompt_set: dict) -> str:
    return f", prompts `{prompt_set['name']}` v{prompt_set['version']}" if "name" in prompt_set else ""


def _token_map_note(token_map: str | None) -> str:
    """Where the served draft has a token map (docs/token-map.md): the in-process rows' has none."""
    return f"; served, the draft's greedy steps score only the token map `{token_map}`" if token_map else ""


def render_markdown(result: dict) -> str:
    """The human-readable report of one benchmark run."""
    settings, machine, steps = result["settings"], result["machine"], result.get("step_latency") or {}
    prompt_set = result["prompt_set"]
    out = [f"# specserve benchmark: {result['name']}", ""]
    out.append(f"- prompts: {_prompt_set_line(prompt_set)}; "
               f"max_tokens {settings['max_tokens']}; {settings['runs']} run(s), tok/s = median over runs")
    out.append(f"- models: target `{settings['target_path']}`, draft `{settings['draft_path']}` "
               f"({settings['dtype']} on {settings['device']}); K = {settings['num_draft_tokens']}"
               f"{' (HTTP rows: adaptive depth)' if settings.get('adaptive') else ''}"
               f"{_token_map_note(settings.get('draft_token_map'))}")
    out.append(f"- machine: {machine['cpu_count']} CPUs, {machine.get('device_name', settings['device'])}, torch "
               f"{machine['torch']}, transformers {machine['transformers']}, ray {machine.get('ray') or 'n/a'}; "
               f"in-process torch threads {settings['threads']}; load average {machine.get('loadavg_start')} → "
               f"{machine.get('loadavg_end')}")
    if steps:
        target_ms = ", ".join(f"t({n})={ms:.2f} ms"
                              for n, ms in sorted(steps["target_ms"].items(), key=lambda kv: int(kv[0])))
        out.append(f"- step latency at context {steps['context_tokens']} (warm cache, median): target {target_ms}; "
                   f"draft t(1)={steps['draft_ms']:.2f} ms; c = {steps['draft_cost_ratio']:.3f}")
    for mode, mode_result in result["modes"].items():
        title = ("greedy" if mode == "greedy" else "sampled (T=0.8)") + _prompt_set_tag(prompt_set)
        out += ["", f"## {title}", "", markdown_table(TABLE_COLUMNS, [_row_cells(r) for r in mode_result["rows"]]),
                "", "Targets (measured, not asserted):", *_target_lines(mode_result)]
        if mode_result.get("sweep"):
            out += _sweep_section(mode_result["sweep"])
    out += ["", "## Notes", ""] + [f"- {note}" for note in result.get("notes", [])]
    return "\n".join(out) + "\n"


def plot_speedup(result: dict, path: Path) -> None:
    """Bars: speed-up vs target-only per row and mode; dots: the overlapped bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(result["modes"])
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        rows = result["modes"][mode]["rows"]
        names = [row["key"] for row in rows]
        values = [row["vs_target_only"] or 0.0 for row in rows]
        bars = ax.bar(names, values, color=["#1f77b4" if r["transport"] == "in-process" else "#ff7f0e" for r in rows])
        for bar, value in zip(bars, values):
            ax.annotate(f"{value:.2f}×", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom",
                        fontsize=8)
        bound_x = [i for i, r in enumerate(rows) if r["bound"] is not None]
        ax.scatter(bound_x, [rows[i]["bound"] for i in bound_x], marker="_", s=400, color="black",
                   label="bound E·t(1)/t(K+1)", zorder=3)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.axhline(SPEEDUP_TARGET_VS_TARGET_ONLY, color="red", linestyle="--", linewidth=0.8,
                   label=f"target {SPEEDUP_TARGET_VS_TARGET_ONLY}× (HTTP)")
        ax.set_title(f"{mode}: tokens/s vs target-only (same transport)")
        ax.set_ylabel("speed-up ×")
        ax.tick_params(axis="x", rotation=30)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_concurrency(result: dict, path: Path) -> bool:
    """tokens/s and p50/p95 latency vs streams; False (no file) when no sweep ran."""
    series = [(mode, app, levels) for mode, mode_result in result["modes"].items()
              for app, levels in (mode_result.get("sweep") or {}).items() if levels]
    if not series:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tps, ax_lat) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode, app, levels in series:
        streams = [level["concurrency"] for level in levels]
        ax_tps.plot(streams, [level["tokens_per_s"] for level in levels], marker="o", label=f"{app} {mode}")
        line, = ax_lat.plot(streams, [level["latency_p50_ms"] for level in levels], marker="o",
                            label=f"{app} {mode} p50")
        ax_lat.plot(streams, [level["latency_p95_ms"] for level in levels], marker="^", linestyle="--",
                    color=line.get_color(), label=f"{app} {mode} p95")
    all_streams = sorted({level["concurrency"] for _, _, levels in series for level in levels})
    for ax, ylabel in ((ax_tps, "tokens/s (all streams)"), (ax_lat, "request latency ms")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_streams, [str(s) for s in all_streams])
        ax.minorticks_off()
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_tps.set_title("throughput vs concurrency (HTTP)")
    ax_lat.set_title("latency vs concurrency (HTTP)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_outputs(result: dict, out_dir: Path) -> list[Path]:
    """<name>.json, <name>.md, <name>_speedup.png, <name>_concurrency.png (if a sweep ran), and the
    same files as latest.* (stale latest files from an earlier run are removed first)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    name = result["name"]
    paths = [out_dir / f"{name}.json", out_dir / f"{name}.md", out_dir / f"{name}_speedup.png"]
    paths[0].write_text(json.dumps(result, indent=1) + "\n")
    paths[1].write_text(render_markdown(result))
    plot_speedup(result, paths[2])
    concurrency_path = out_dir / f"{name}_concurrency.png"
    if plot_concurrency(result, concurrency_path):
        paths.append(concurrency_path)
    for stale in out_dir.glob("latest*"):
        stale.unlink()
    for path in list(paths):
        latest = out_dir / path.name.replace(name, "latest", 1)
        shutil.copyfile(path, latest)
        paths.append(latest)
    return paths
