"""Tensor parallelism on this box: memory per rank and what TP=2 costs per forward against TP=1.

    python -m specserve.bench.figures.tensor_parallel [--hidden 1024] [--layers 8] [--reps 20] [--out bench/results/...]

A random Llama checkpoint (default 160M parameters: 0.32 GB in bfloat16 on disk, 0.64 GB loaded
in float32) is written to a temp dir, then, each phase in fresh processes (torch.multiprocessing, gloo, one torch thread each):
1. memory: one TP=1 process and a TP=2 group each load it; every process reports its RSS after
   imports and after loading (total, its own memory RssAnon, and RssFile: the checkpoint's pages
   it mapped, page cache shared by the ranks), and the weight bytes it holds
   (decoding.tensor_parallel.weight_bytes);
2. time: in the TP=2 group, rank 0 also loads the whole model as a TP=1 runner, and the two take
   turns every repetition on the shapes a target engine sees (a K=4 verify of 1 and of 8 sequences,
   a 1-token step), 128 cached tokens each; the median ms per forward of each, and the largest
   logit difference between them;
3. collectives: on the same group, the collectives one TP=2 forward of each shape makes, timed
   alone: rank 0's call broadcast (decoding.tensor_parallel.MirroredRunner), 1 + 2 x layers
   all-reduces of the hidden states (embedding, attention and MLP outputs) and the all-gather of
   the kept rows' logits.
On 2 CPU cores expect no speed-up: both ranks share the two cores TP=1 uses one of; the point is
correctness and memory. Writes a JSON and a Markdown report beside it (docs/tensor-parallel.md
quotes the report).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

SHAPES = ((1, 1), (1, 5), (8, 5))   # (sequences, new tokens each)
CACHED = 128


def write_checkpoint(folder: Path, hidden: int, layers: int, vocab: int) -> int:
    """A random Llama of the given shape saved as bfloat16 safetensors, as real checkpoints ship
    (loaded in float32, the CPU default, every weight is a copy in the process's own memory; a
    float32 file loaded as float32 would be used in place through mmap, its pages counted as the
    page cache's, not the process's); -> its parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64,
                         num_key_value_heads=hidden // 128, max_position_embeddings=1024,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def spec(path: str, member: dict | None) -> dict:
    return {"path": path, "dtype": "float32", "device": "cpu", "torch_threads": 1, "max_sequences": 16,
            "lean_forward": True, "kv_cache_memory_gb": 0.25, **({"tensor_parallel": member} if member else {})}


def rss_bytes() -> dict[str, int]:
    """This process's resident memory: total, its own (RssAnon), and mapped files' pages (RssFile:
    the checkpoint read through mmap, page cache shared by the ranks)."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssFile"):
                fields[name] = int(value.split()[0]) * 1024
    return {"total": fields["VmRSS"], "own": fields["RssAnon"], "file": fields["RssFile"]}


def histories(rows: int) -> dict[str, list[int]]:
    return {f"s{row}": [(7 * row + 3 * i) % 900 + 2 for i in range(CACHED)] for row in range(rows)}


def time_shapes(runners: dict, reps: int) -> dict:
    """Median ms per forward of each runner per shape (taking turns), and their largest logit gap."""
    from specserve.bench.figures.lean_forward import forwards_in_turns

    shapes = {}
    for rows, new in SHAPES:
        held = histories(rows)
        medians, logits = forwards_in_turns(runners, held, new, reps, warmup=3)
        for each in runners.values():
            for seq_id in held:
                each.release(seq_id)
        shapes[f"{rows}x{new}"] = {**{f"{name}_ms": round(ms, 2) for name, ms in medians.items()},
                                   "max_abs_logit_diff": max(float((a - b).abs().max())
                                                             for a, b in zip(logits["tp1"], logits["tp2"]))}
    return shapes


def time_collectives(control, hidden: int, layers: int, vocab: int, size: int, reps: int) -> dict:
    """Rank 0's view of the collectives one TP forward of each shape makes, timed alone (ms)."""
    import torch.distributed as dist

    from specserve.decoding.block_manager import BlockManager, ForwardCall
    from specserve.decoding.paged_cache import full_attention

    out = {}
    for rows, new in SHAPES:
        held = histories(rows)
        blocks = BlockManager(4096, 16, full_attention(layers), rows, CACHED + new)   # what rank 0 sends: a planned step
        blocks.commit(blocks.plan([ForwardCall(seq_id, history) for seq_id, history in held.items()]))
        message = [("run", (blocks.plan([ForwardCall(seq_id, history + history[:new], new)
                                         for seq_id, history in held.items()]),))]
        states = torch.zeros(rows, new, hidden)
        gathered = [torch.zeros(rows * new, vocab // size) for _ in range(size)]
        samples = []
        for rep in range(reps + 3):
            dist.barrier()
            started = time.perf_counter()
            dist.broadcast_object_list(list(message), src=0, group=control)
            for _ in range(1 + 2 * layers):
                dist.all_reduce(states)
            dist.all_gather(gathered, torch.zeros(rows * new, vocab // size))
            if rep >= 3:
                samples.append(time.perf_counter() - started)
        out[f"{rows}x{new}"] = round(1000 * statistics.median(samples), 2)
    return out


def _process(rank: int, size: int, store_address: str, path: str, phase: str, options: dict, results) -> None:
    import transformers  # noqa: F401  (imports are part of the baseline RSS, as in an engine)

    from specserve.decoding.batched_runner import load_runner
    from specserve.decoding.tensor_parallel import weight_bytes

    torch.set_num_threads(1)
    before = rss_bytes()
    member = None if size == 1 else {"rank": rank, "size": size, "store_address": store_address}
    loaded = load_runner(spec(path, member))
    runner = getattr(loaded, "runner", loaded)
    measured = {"rank": rank, "size": size, "rss_after_imports_bytes": before, "rss_after_load_bytes": rss_bytes(),
              "weight_bytes": weight_bytes(runner.model)}
    if phase == "time" and rank == 0:
        from specserve.decoding.scheduler import Scheduler

        whole = load_runner(spec(path, None))
        measured["shapes"] = time_shapes({"tp1": Scheduler(whole), "tp2": Scheduler(loaded)}, options["reps"])
        loaded.stop_followers()
    elif phase == "time":
        loaded.follow()
    if phase == "time":
        measured["collectives_ms"] = time_collectives(loaded.control_group, options["hidden"], options["layers"],
                                                    options["vocab"], size, options["reps"])
    elif size > 1 and rank == 0:
        loaded.stop_followers()
    elif size > 1:
        loaded.follow()
    results.put(measured)


def run(path: str, size: int, phase: str, options: dict) -> list[dict]:
    from specserve.decoding.tensor_parallel import host_store

    store, address = host_store("127.0.0.1")   # served by this process while the group runs
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_process, args=(rank, size, address, path, phase, options, results))
                 for rank in range(size)]
    for process in processes:
        process.start()
    reports = sorted((results.get(timeout=1800) for _ in processes), key=lambda each: each["rank"])
    for process in processes:
        process.join(timeout=60)
    return reports


def report(result: dict) -> str:
    """The Markdown tables docs/tensor-parallel.md quotes (MiB = 2^20 bytes)."""
    mib = 2 ** 20
    model, memory = result["model"], result["memory"]
    whole = memory["tp1"][0]
    lines = [f"# TP=1 vs TP=2 on {result['machine']['cpus']} CPU cores (gloo), `python -m specserve.bench.figures.tensor_parallel`", "",
             f"A random Llama of {model['parameters']:,} parameters (hidden {model['hidden']}, {model['layers']} layers, "
             f"{model['hidden'] // 64} heads / {model['hidden'] // 128} KV heads, vocabulary {model['vocab']:,}), "
             f"bfloat16 on disk, loaded in float32: {whole['weight_bytes'] / mib:.0f} MiB of weights. "
             "One torch thread per process.", "",
             "| process | weights held (MiB) | own memory for the model (RssAnon after load - after imports, MiB) "
             "| total RSS after load (MiB) |", "|---|---|---|---|"]
    for name, reports in memory.items():
        for each in reports:
            lines.append(f"| {name.upper()} rank {each['rank']} | {each['weight_bytes'] / mib:.0f} | "
                         f"{each['own_rss_for_model_bytes'] / mib:.0f} | {each['rss_after_load_bytes']['total'] / mib:.0f} |")
    split = memory["tp2"][0]
    lines += ["", f"Own memory saved per rank: {(whole['own_rss_for_model_bytes'] - split['own_rss_for_model_bytes']) / mib:.0f} "
              f"MiB (half the weights: {whole['weight_bytes'] / 2 / mib:.0f} MiB); what is not weights: "
              f"{(split['own_rss_for_model_bytes'] - split['weight_bytes']) / mib:.0f} MiB at TP=2, "
              f"{(whole['own_rss_for_model_bytes'] - whole['weight_bytes']) / mib:.0f} MiB at TP=1.", "",
              f"Per forward, {CACHED} cached tokens a sequence, the two taking turns (median of {model['reps']}):", "",
              "| forward (sequences x new tokens) | TP=1 ms | TP=2 ms | collectives of one TP=2 forward alone, ms "
              "| max logit difference |", "|---|---|---|---|---|"]
    for shape, timing in result["forward_ms"].items():
        lines.append(f"| {shape} | {timing['tp1_ms']} | {timing['tp2_ms']} | {result['collectives_ms'][shape]} | "
                     f"{timing['max_abs_logit_diff']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specserve.bench.figures.tensor_parallel", description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default="bench/results/cpu-2core-tensor-parallel.json")
    args = parser.parse_args(argv)
    options = {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "reps": args.reps}
    with tempfile.TemporaryDirectory() as folder:
        parameters = write_checkpoint(Path(folder), args.hidden, args.layers, args.vocab)
        memory = {"tp1": run(folder, 1, "memory", options), "tp2": run(folder, 2, "memory", options)}
        timed = run(folder, 2, "time", options)
    for reports in memory.values():
        for each in reports:
            each["own_rss_for_model_bytes"] = each["rss_after_load_bytes"]["own"] - each["rss_after_imports_bytes"]["own"]
    result = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
              "model": {**options, "parameters": parameters, "float32_bytes": 4 * parameters},
              "memory": memory, "forward_ms": timed[0]["shapes"], "collectives_ms": timed[0]["collectives_ms"]}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    Path(args.out).with_suffix(".md").write_text(report(result))
    print(report(result))


if __name__ == "__main__":
    main()
