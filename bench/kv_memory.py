"""KV memory and forward time: the paged KV cache (decoding.paged_cache) against the slot cache it
replaced (bench.slot_cache), on the default target (fp32, one thread).

    python -m specserve.bench.kv_memory [--reps 15] [--streams 16] [--seed 0]

1. Forward time at the shapes of shared/README.md's batching table (rows x new tokens, 128 cached
   tokens a row): the lean decoder forward over each cache, layout building included, the two
   caches taking turns every repetition (the box is shared: turns make a busy spell hit both).
   CPU time of the forward's thread (one torch thread) is the comparison: on a shared box wall time
   mostly measures the other sessions; wall medians are reported beside it.
   The paged rows' blocks are interleaved in the pool, as concurrent streams leave them; the slot
   rows are neighbouring slots, the slot cache's best case (its keys are read as a view).
2. Bytes at `--streams` streams of mixed lengths: a BatchedModelRunner (paged) runs speculative
   rounds for every stream together (verify 6 tokens, keep a random 1..6: rollback every round)
   until each reaches its length; reserved (pool tensors held), in blocks and in tokens held are
   sampled every round. The slot cache's reservation for the same streams is what its tensors
   take once they hold that many sequences (its chunks of 8 slots of max_model_len tokens).
3. The same arithmetic from Llama-3.1-8B's published shapes (config only).

Writes bench/results/kv-memory.json and prints the markdown of bench/results/kv-memory.md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
from transformers import LlamaConfig

from specserve.decoding.batched_runner import BatchedModelRunner
from specserve.decoding.lean_forward import LeanDecoder
from specserve.decoding.model_runner import ForwardCall, load_causal_lm
from specserve.decoding.paged_cache import GIB, PagedKVCache, blocks_for, kv_bytes_per_token, kv_capacity, paged_layout
from specserve.bench.slot_cache import SlotKVCache, batch_layout

TARGET = Path(__file__).resolve().parents[1] / "models" / "default" / "target"
RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
SHAPES = ((1, 1), (8, 5), (16, 5))
CACHED = 128
# Llama-3.1-8B's published config (shared/CHECKPOINTS.md): the shapes the KV arithmetic needs.
LLAMA_31_8B = dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, hidden_size=4096,
                   head_dim=128, max_position_embeddings=131072)


class _Filled:
    """One cache holding `rows` sequences of CACHED tokens, and how to run a forward over it."""

    def __init__(self, kind: str, model, lean: LeanDecoder, rows: int, block_size: int = 16) -> None:
        self.kind, self.lean, self.rows = kind, lean, rows
        layers = model.config.num_hidden_layers
        if kind == "slot":
            self.cache = SlotKVCache(layers, max_len=model.config.max_position_embeddings, max_slots=rows)
            self.slots = [self.cache.allocate() for _ in range(rows)]
        else:
            self.cache = PagedKVCache(layers, num_blocks=4096, block_size=block_size)
            per_row = blocks_for(CACHED + 8, block_size)
            pool = self.cache.allocate(rows * per_row)
            self.tables = [pool[row::rows] for row in range(rows)]   # interleaved, as concurrent growth leaves them
        generator = torch.Generator().manual_seed(rows)
        prompt = torch.randint(2, model.config.vocab_size, (rows, CACHED), generator=generator)
        self.forward(prompt, [0] * rows)

    def forward(self, input_ids: torch.Tensor, starts: list[int]) -> torch.Tensor:
        rows, new = input_ids.shape
        if self.kind == "slot":
            layout = batch_layout(self.slots, starts, [new] * rows, torch.float32, torch.device("cpu"))
        else:
            layout = paged_layout([self.tables], starts, [new] * rows, self.cache.block_size, torch.float32,
                                  torch.device("cpu"))
        keep_index = torch.arange(rows) * new + new - 1   # each row's last position
        with torch.inference_mode():
            return self.lean.forward(input_ids, layout.position_ids, self.cache.view(layout, keep_index))


def forward_times(model, reps: int) -> list[dict]:
    lean = LeanDecoder(model)
    results = []
    for rows, new in SHAPES:
        filled = {kind: _Filled(kind, model, lean, rows) for kind in ("slot", "paged")}
        input_ids = torch.randint(2, model.config.vocab_size, (rows, new), generator=torch.Generator().manual_seed(1))
        wall: dict[str, list[float]] = {kind: [] for kind in filled}
        cpu: dict[str, list[float]] = {kind: [] for kind in filled}
        logits = {}
        for rep in range(reps + 2):
            order = list(filled) if rep % 2 == 0 else list(reversed(filled))
            for kind in order:
                started, started_cpu = time.perf_counter(), time.thread_time()
                logits[kind] = filled[kind].forward(input_ids, [CACHED] * rows)
                if rep >= 2:
                    wall[kind].append(time.perf_counter() - started)
                    cpu[kind].append(time.thread_time() - started_cpu)
        results.append({"rows": rows, "new_tokens": new, "cached": CACHED,
                        **{f"{kind}_ms": round(1000 * statistics.median(v), 2) for kind, v in wall.items()},
                        **{f"{kind}_cpu_ms": round(1000 * statistics.median(v), 2) for kind, v in cpu.items()},
                        "max_abs_logit_diff": float((logits["slot"] - logits["paged"]).abs().max())})
    return results


def stream_memory(model, streams: int, seed: int) -> dict:
    """Speculative rounds for `streams` streams of mixed lengths through the paged runner."""
    rng = random.Random(seed)
    runner = BatchedModelRunner.from_model(model, max_sequences=streams)
    max_len = runner.max_context
    lengths = {f"s{i}": (rng.randint(8, 300), rng.randint(16, 160)) for i in range(streams)}  # (prompt, output)
    histories = {seq_id: [rng.randint(2, 8000) for _ in range(prompt)] for seq_id, (prompt, _) in lengths.items()}
    bytes_per_token = runner.kv_capacity.bytes_per_token
    block_bytes = bytes_per_token * runner.block_size
    runner.forward_batch([ForwardCall(seq_id, history) for seq_id, history in histories.items()])
    samples = []
    while live := [s for s in histories if len(histories[s]) < sum(lengths[s])]:
        block = {s: [rng.randint(2, 8000) for _ in range(5)] for s in live}
        runner.forward_batch([ForwardCall(s, histories[s] + block[s], 6) for s in live])
        for s in live:   # keep 1..6 tokens of the round; the next call crops the rest
            histories[s] += (block[s] + [rng.randint(2, 8000)])[:rng.randint(1, 6)]
        usage = runner.kv_usage()
        samples.append({"reserved": usage["kv_bytes_reserved"], "in_blocks": usage["kv_blocks_used"] * block_bytes,
                        "held": usage["kv_tokens_held"] * bytes_per_token, "blocks": usage["kv_blocks_used"],
                        "tokens": usage["kv_tokens_held"]})
    for seq_id in histories:
        runner.release(seq_id)
    assert runner.kv_usage()["kv_blocks_used"] == 0, "blocks leaked"
    slot = SlotKVCache(model.config.num_hidden_layers, max_len=max_len, max_slots=streams)
    for _ in range(streams):
        slot.allocate()
    slot_reserved = slot.capacity * max_len * bytes_per_token
    peak = max(samples, key=lambda sample: sample["held"])
    mean = {key: statistics.mean(sample[key] for sample in samples) for key in peak}
    # The same streams' blocks and tokens at Llama-3.1-8B's bytes a token and context.
    llama = kv_bytes_per_token(LlamaConfig(**LLAMA_31_8B), torch.bfloat16)
    llama_slots = -(-streams // 8) * 8
    projected = {"bytes_per_token": llama, "in_blocks": peak["blocks"] * runner.block_size * llama,
                 "held": peak["tokens"] * llama,
                 "slot_reserved": llama_slots * LLAMA_31_8B["max_position_embeddings"] * llama}
    return {"streams": streams, "rounds": len(samples), "max_model_len": max_len,
            "final_lengths": sorted(len(h) for h in histories.values()),
            "paged_at_peak_bytes": peak, "paged_mean_bytes": mean, "slot_reserved_bytes": slot_reserved,
            "at_llama_3_1_8b_shapes": projected}


def llama_arithmetic(budget_gib: float = 16.0, streams: int = 16, tokens_each: int = 1024) -> dict:
    config = LlamaConfig(**LLAMA_31_8B)
    capacity = kv_capacity(config, torch.bfloat16, budget_gib * GIB, config.max_position_embeddings)
    per_token = kv_bytes_per_token(config, torch.bfloat16)
    return {"bytes_per_token": per_token, "budget_gib": budget_gib, "capacity_tokens": capacity.tokens,
            "full_length_sequences": capacity.full_length_sequences,
            "sequences_of_1k": capacity.num_blocks // blocks_for(tokens_each, capacity.block_size),
            "slot_reserved_gib_for_16": 8 * 2 * config.max_position_embeddings * per_token / GIB,
            "paged_gib_for_16_of_1k": streams * blocks_for(tokens_each, 16) * 16 * per_token / GIB}


def markdown(result: dict) -> str:
    mib = 1 << 20
    lines = ["# KV memory: paged blocks against per-sequence slots", "",
             "`python -m specserve.bench.kv_memory` (default target, fp32, 1 thread, this 2-core box, shared with other "
             "sessions while it ran; caches take turns every repetition; medians of "
             f"{result['reps']} forwards; CPU ms = the forward thread's CPU time, what a busy box distorts least).", "",
             "## Forward time (lean forward, layout included, 128 cached tokens a row)", "",
             "| rows x new tokens | slot cache CPU ms | paged CPU ms | paged / slot (CPU) | wall ms slot / paged "
             "| max logit diff |", "|---|---|---|---|---|---|"]
    for row in result["forward"]:
        lines.append(f"| {row['rows']}x{row['new_tokens']} | {row['slot_cpu_ms']} | {row['paged_cpu_ms']} | "
                     f"{row['paged_cpu_ms'] / row['slot_cpu_ms']:.2f} | {row['slot_ms']} / {row['paged_ms']} | "
                     f"{row['max_abs_logit_diff']:.1e} |")
    memory = result["memory"]
    peak, mean = memory["paged_at_peak_bytes"], memory["paged_mean_bytes"]
    lines += ["", f"## Bytes at {memory['streams']} streams of mixed lengths "
              f"(final lengths {memory['final_lengths'][0]}..{memory['final_lengths'][-1]} tokens, "
              f"max_model_len {memory['max_model_len']}, {memory['rounds']} rounds with rollback)", "",
              "| | reserved MiB | in blocks MiB | tokens held MiB | held / reserved |", "|---|---|---|---|---|",
              f"| slot cache | {memory['slot_reserved_bytes'] / mib:.1f} | - | {peak['held'] / mib:.1f} | "
              f"{peak['held'] / memory['slot_reserved_bytes']:.2f} |"]
    for name, sample in (("paged, at peak", peak), ("paged, mean over rounds", mean)):
        lines.append(f"| {name} | {sample['reserved'] / mib:.1f} | {sample['in_blocks'] / mib:.1f} | "
                     f"{sample['held'] / mib:.1f} | {sample['held'] / sample['reserved']:.2f} |")
    llama, projected = result["llama_3_1_8b"], memory["at_llama_3_1_8b_shapes"]
    lines += ["", "Paged reserved is the pool's tensors (grown by half again on CPU, so up to 1.5x the blocks in "
              "use; on CUDA the whole budget is allocated at start); the slot cache reserves max_model_len tokens "
              "for every slot of its chunk of 8.", "",
              f"The same streams at Llama-3.1-8B's shapes (bf16, max_model_len 131,072), at the peak: in blocks "
              f"{projected['in_blocks'] / GIB:.2f} GiB for {projected['held'] / GIB:.2f} GiB of tokens held; "
              f"the slot cache would reserve {projected['slot_reserved'] / GIB:,.0f} GiB.", "",
              "## Llama-3.1-8B shapes (config only, bf16)", "",
              f"{llama['bytes_per_token'] // 1024} KiB a token. A {llama['budget_gib']:.0f} GiB budget holds "
              f"{llama['capacity_tokens']:,} tokens: {llama['full_length_sequences']} sequence(s) of 131,072 tokens, "
              f"or {llama['sequences_of_1k']} of 1,024. 16 sequences of 1k tokens take "
              f"{llama['paged_gib_for_16_of_1k']:.1f} GiB paged; the slot cache reserved "
              f"{llama['slot_reserved_gib_for_16']:.0f} GiB for them (two chunks of 8 slots of 131,072 tokens)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specserve.bench.kv_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    model = load_causal_lm(str(TARGET), dtype="float32", device="cpu", num_threads=1)
    result = {"reps": args.reps, "forward": forward_times(model, args.reps),
              "memory": stream_memory(model, args.streams, args.seed), "llama_3_1_8b": llama_arithmetic()}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "kv-memory.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (RESULTS / "kv-memory.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
