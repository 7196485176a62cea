"""Tensor-parallel engines without Ray: a TP=2 gloo group of two processes on the Llama-3 and Qwen3
look-alike targets. Rank 0's engine (a Scheduler over a MirroredRunner) runs the calls an engine
makes (ragged prefills, a verify block, a rollback, a pre-draft's fork and adopt, a release, greedy
decoding); rank 1 follows the planned steps it is sent. The logits must equal one unsharded
engine's, greedy must equal HF generate, each rank must hold about half the weights, and a
follower receives only each step's new tokens and answers no logits.

The equalities asserted here hold on CPU in float32, where the tests run; on a GPU in bf16 greedy
output may differ at near-ties and with what shares a batch (docs/gpu.md)."""

import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM

from specserve.decoding.batched_runner import load_runner
from specserve.decoding.block_manager import ForwardCall
from specserve.decoding.scheduler import Scheduler
from tests.checkpoint_fixtures import build_llama3, build_qwen3

# Sharded matmuls sum in another order than whole ones (all-reduce of partial sums): ~1e-6 on
# these O(1) logits; a wrong head split or a rank out of step moves them by far more (the broken
# variant below is rejected by the same tolerance).
ATOL = 1e-4
GREEDY_TOKENS = 12


def _prompt(seed: int, length: int, vocab: int = 8000) -> list[int]:
    return torch.randint(10, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine_calls(engine: Scheduler) -> list[torch.Tensor]:
    """What a verifying (and pre-drafting) engine runs, in order; the rows of every forward."""
    a, b = _prompt(1, 37), _prompt(2, 11)
    rows = list(engine.forward_batch([ForwardCall("a", a), ForwardCall("b", b)]))
    block = _prompt(3, 4)
    rows += engine.forward_batch([ForwardCall("a", a + block, 5), ForwardCall("b", b + block[:1], 2)])
    rows += engine.forward_batch([ForwardCall("a", a + block[:2] + _prompt(4, 3), 4)])   # a rollback by crop
    engine.blocks.fork("a", "branch")   # a pre-draft's branch shares a's blocks, then writes its own
    rows += engine.forward_batch([ForwardCall("branch", a + block[:3], 3)])
    engine.blocks.adopt("a", "branch")
    rows += engine.forward_batch([ForwardCall("a", a + block, 2)])
    engine.blocks.rollback("b", 5)
    rows += engine.forward_batch([ForwardCall("b", b, 3)])
    engine.release("b")
    rows += engine.forward_batch([ForwardCall("c", b + block, 2)])   # b's cached prefix blocks
    history = list(a)
    for _ in range(GREEDY_TOKENS):
        logits = engine.forward("g", history)
        rows.append(logits)
        history.append(int(logits[-1].argmax()))
    return rows


def _spec(path: Path, member: dict | None = None) -> dict:
    return {"path": str(path), "dtype": "float32", "device": "cpu", "torch_threads": 1, "max_sequences": 8,
            "lean_forward": True, "kv_cache_memory_gb": 0.01, **({"tensor_parallel": member} if member else {})}


def _rank_main(rank: int, size: int, store_address: str, path: str, results, scenario: str = "calls") -> None:
    from specserve.decoding.tensor_parallel import weight_bytes

    torch.set_num_threads(1)
    in_group = load_runner(_spec(Path(path), {"rank": rank, "size": size, "store_address": store_address}))
    if scenario == "follower_dies":
        _follower_dies(rank, in_group, results)
        return
    runner = in_group.runner
    facts = {"weight_bytes": weight_bytes(runner.model), "kv_bytes_per_token": runner.kv_capacity.bytes_per_token,
             "lean": runner.lean is not None}
    # What each rank's runner runs: the tokens of each planned step, and whether it answered logits.
    ran = {"tokens": 0, "answers": 0}
    run = runner.run

    def counted_run(plan, **options):
        answer = run(plan, **options)
        ran["tokens"] += plan.num_new_tokens
        ran["answers"] += bool(answer)
        return answer

    runner.run = counted_run
    if rank == 0:
        rows = engine_calls(Scheduler(in_group))
        in_group.stop_followers()
        facts.update(ran)
        # numpy: a torch tensor would cross in shared memory that dies with this process
        results.put((rank, facts, [row.numpy() for row in rows]))
    else:
        facts["calls"] = in_group.follow()
        facts.update(ran)
        results.put((rank, facts, None))


def _follower_dies(rank: int, in_group, results) -> None:
    """Rank 1 ends its process once loaded; rank 0 then calls: it must fail, not wait."""
    import os

    from specserve.decoding.tensor_parallel import GroupBrokenError

    if rank == 1:
        os._exit(0)
    broken = []
    in_group.on_broken = broken.append
    started = time.monotonic()
    outcome = "no error"
    for _ in range(3):   # the first send may still be buffered by the closing socket
        try:
            engine_calls(Scheduler(in_group))
        except GroupBrokenError:
            outcome = "GroupBrokenError"
            break
    results.put((rank, {"outcome": outcome, "hook_called": len(broken) == 1,
                        "seconds": time.monotonic() - started}, None))


def run_group(path: Path, size: int = 2, scenario: str = "calls") -> dict[int, tuple[dict, list | None]]:
    """Run a scenario on a TP group of size processes: engine_calls by default; -> rank: (facts,
    rows of rank 0), for the ranks that report."""
    from specserve.decoding.tensor_parallel import host_store

    store, address = host_store("127.0.0.1")   # this process serves the group's store while it runs
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_rank_main, args=(rank, size, address, str(path), results, scenario))
                 for rank in range(size)]
    for process in processes:
        process.start()
    gathered = {}
    for _ in range(size if scenario == "calls" else 1):
        rank, facts, rows = results.get(timeout=600)   # generous: a loaded 2-core box imports slowly
        gathered[rank] = (facts, rows and [torch.from_numpy(row) for row in rows])
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    return gathered


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, Path]:
    return {name: build(tmp_path_factory.mktemp(name)).target
            for name, build in (("llama3", build_llama3), ("qwen3", build_qwen3))}


@pytest.fixture(scope="module", params=["llama3", "qwen3"])
def family(request, targets):
    target = targets[request.param]
    whole = Scheduler(load_runner(_spec(target)))
    return target, whole, engine_calls(whole), run_group(target)


def test_tp2_logits_equal_one_unsharded_runner(family):
    _, _, expected, group = family
    rows = group[0][1]
    assert len(rows) == len(expected)
    for got, want in zip(rows, expected):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_the_tolerance_catches_a_rank_out_of_step(family):
    """The broken variant: logits of the wrong history (one token off, as a follower that missed a
    rollback would compute) differ by far more than ATOL."""
    target, whole, expected, _ = family
    a = _prompt(1, 37)
    shifted = whole.forward("shifted", a[:-2] + [a[-1], a[-2]])
    assert (shifted - expected[0]).abs().max() > 100 * ATOL


def test_tp2_greedy_equals_hf_generate(family):
    target, _, _, group = family
    greedy = [int(row[-1].argmax()) for row in group[0][1][-GREEDY_TOKENS:]]
    model = AutoModelForCausalLM.from_pretrained(target, local_files_only=True, dtype=torch.float32).eval()
    prompt = _prompt(1, 37)
    generated = model.generate(torch.tensor([prompt]), max_new_tokens=GREEDY_TOKENS, do_sample=False,
                               min_new_tokens=GREEDY_TOKENS, eos_token_id=None, pad_token_id=0)
    assert greedy == generated[0, len(prompt):].tolist()


def test_each_rank_holds_half_the_weights_and_half_the_kv(family):
    _, whole, _, group = family
    whole_bytes = sum(p.numel() * p.element_size() for p in whole.runner.model.parameters())
    for rank in (0, 1):
        facts = group[rank][0]
        # The plan splits every projection, the embedding and the LM head; only norms are whole.
        assert 0.45 * whole_bytes < facts["weight_bytes"] < 0.55 * whole_bytes
        assert facts["kv_bytes_per_token"] * 2 == whole.runner.kv_capacity.bytes_per_token
        assert not facts["lean"]   # the sharded model runs its own forward (the plan's collectives)


def test_followers_run_each_planned_step_from_its_new_tokens_and_answer_no_logits(family):
    """Rank 0 sends each forward's plan, not the histories behind it (fork, adopt, rollback and
    release stay with its block manager): the follower runs as many steps and exactly the new
    tokens rank 0 runs, far fewer than the histories named, and keeps no logits."""
    _, _, _, group = family
    leader, follower = group[0][0], group[1][0]
    assert follower["calls"] == 7 + GREEDY_TOKENS   # the forwards; the block operations are rank 0's alone
    assert follower["tokens"] == leader["tokens"] and follower["answers"] == 0
    named = (37 + 11) + (41 + 12) + 42 + 40 + 41 + 11 + 15 + sum(37 + i for i in range(GREEDY_TOKENS))
    assert follower["tokens"] < named / 4   # the histories engine_calls names: 760 tokens


def test_a_dead_follower_breaks_the_group_at_rank_0s_next_call_without_waiting(targets):
    """Rank 0 must not hang in a collective when a rank dies: the broken connection ends the call
    with GroupBrokenError (and the engine's hook: deployments.engine_group.end_process) within
    seconds, well inside the collective timeout."""
    facts = run_group(targets["llama3"], scenario="follower_dies")[0][0]
    assert facts["outcome"] == "GroupBrokenError" and facts["hook_called"]
    assert facts["seconds"] < 60


def test_the_groups_collective_timeout_is_a_setting_that_covers_a_long_shard_load(tmp_path):
    """The first collective after loading waits for the slowest rank's shards: the group's timeout
    comes from the config (tensor_parallel_timeout_s, an hour by default) through the engine spec
    to every rank's TensorParallelRank."""
    from specserve.cluster.builder import served_model_specs
    from specserve.decoding.tensor_parallel import TensorParallelRank
    from specserve.deployments.engine_group import rank_spec
    from tests.tiny_pair import tiny_pair_config

    config = tiny_pair_config(tmp_path, "tiny", 8000)
    assert config.target_workers.tensor_parallel_timeout_s >= 3600
    config.target_workers.tensor_parallel_timeout_s = 7200.0
    target, _ = served_model_specs(config)
    member = rank_spec(target, 1, 2, "127.0.0.1:1")["tensor_parallel"]
    assert TensorParallelRank(**member).timeout_s == 7200.0


def test_every_public_runner_method_is_mirrored_or_read_only():
    """A runner method added later that writes KV must be mirrored, or the followers' pools drift
    from rank 0's: each public method is classified as mirrored, read-only, or one a group never
    takes."""
    from specserve.decoding.batched_runner import BatchedModelRunner
    from specserve.decoding.tensor_parallel import MIRRORED_CALLS, READ_ONLY_CALLS, UNSPLIT_CALLS

    public = {name for name in dir(BatchedModelRunner)
              if not name.startswith("_") and callable(getattr(BatchedModelRunner, name))}
    assert public == set(MIRRORED_CALLS) | set(READ_ONLY_CALLS) | set(UNSPLIT_CALLS)
