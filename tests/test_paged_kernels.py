"""The paged cache's attention kernels agree, and a step's forward reads no host value.

The in-place flex_attention kernel (decoding.paged_attention.flex_paged_attention: a block mask
from the block tables, windows and causality as a mask_mod, soft-caps as a score_mod) is checked
against the gathering SDPA reference over the same stores: ragged rows, padding columns, blocks
scattered over the pool, a windowed group's let-go blocks (NO_BLOCK), GQA. Then the runner's
forward, eager, under a dispatch mode that counts the operations that make the host wait on the
device (a scalar read, an output whose size depends on the data): none may run in a step. On
CUDA, torch.cuda.set_sync_debug_mode says the same of a real device; here the ops themselves are
counted, which is what a device would wait on."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specserve.decoding.block_manager import ForwardCall
from specserve.decoding.scheduler import engine_for_model
from specserve.decoding.compiled_forward import CUDA_GRAPH_BATCH_SIZES, graph_batch_size, pad_kept, pad_rows
from specserve.decoding.paged_cache import NO_BLOCK, KVGroup, PagedKVCache, paged_layout
from tests.tiny_pair import tiny_model

ATOL = 1e-5
BLOCK = 4


def filled_cache(heads: int, head_dim: int, seed: int, windowed: bool) -> tuple[PagedKVCache, list, list, list]:
    """A one-layer cache whose 3 rows hold 13, 5 and 22 tokens in scattered blocks and bring 3, 1
    and 2 new ones (ragged: padding columns); with windowed, row 2's first 3 blocks were let go."""
    torch.manual_seed(seed)
    cache = PagedKVCache(num_layers=1, num_blocks=40, block_size=BLOCK, groups=(KVGroup((0,), 6 if windowed else None),))
    starts, num_new = [13, 5, 22], [3, 1, 2]
    cache.reserve(40)   # the pools' memory (the block manager, not the cache, hands out block ids)
    blocks = list(range(40))
    order = torch.randperm(40).tolist()
    tables, used = [], 0
    for start, n in zip(starts, num_new):
        count = -(-(start + n) // BLOCK)
        tables.append([blocks[i] for i in order[used:used + count]])
        used += count
    # Every block holds keys (as if earlier forwards stored them): random keys and values.
    layout = paged_layout([tables], [0] * 3, [start for start in starts], BLOCK, torch.float32, torch.device("cpu"))
    cache.view(layout).update(torch.randn(3, heads, max(starts), head_dim),
                              torch.randn(3, heads, max(starts), head_dim), 0)
    if windowed:
        tables[2][:3] = [NO_BLOCK] * 3
    return cache, tables, starts, num_new


@pytest.mark.parametrize("window, softcap, query_heads", [(None, None, 4), (None, None, 8), (6, None, 4),
                                                           (None, 5.0, 8), (6, 5.0, 8)])
def test_flex_paged_attention_equals_the_gathering_reference(window, softcap, query_heads):
    outputs = {}
    for kernel in ("gather", "flex"):
        cache, tables, starts, num_new = filled_cache(heads=4, head_dim=8, seed=0, windowed=window is not None)
        layout = paged_layout([tables], starts, num_new, BLOCK, torch.float32, torch.device("cpu"))
        generator = torch.Generator().manual_seed(1)
        query = torch.randn(3, query_heads, 3, 8, generator=generator)
        keys, values = torch.randn(3, 4, 3, 8, generator=generator), torch.randn(3, 4, 3, 8, generator=generator)
        outputs[kernel] = cache.view(layout, kernel=kernel).attend(0, query, keys, values, scaling=0.3,
                                                                   sliding_window=window, softcap=softcap)
    real = [(b, t) for b, n in enumerate(num_new) for t in range(n)]   # padding columns are never read
    for b, t in real:
        torch.testing.assert_close(outputs["flex"][b, :, t], outputs["gather"][b, :, t], atol=ATOL, rtol=0)


def test_the_comparison_catches_a_kernel_that_ignores_the_window():
    """The agreement above can fail: flex without the window differs from the windowed reference."""
    cache, tables, starts, num_new = filled_cache(heads=4, head_dim=8, seed=0, windowed=False)
    layout = paged_layout([tables], starts, num_new, BLOCK, torch.float32, torch.device("cpu"))
    query, keys, values = torch.randn(3, 4, 3, 8), torch.randn(3, 4, 3, 8), torch.randn(3, 4, 3, 8)
    windowed = cache.view(layout).attend(0, query, keys, values, sliding_window=6)
    unwindowed = cache.view(layout, kernel="flex").attend(0, query, keys, values)
    assert float((windowed[0, :, 0] - unwindowed[0, :, 0]).abs().max()) > 100 * ATOL


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_a_lone_rows_one_token_step_needs_no_mask_and_attends_as_flex_does(softcap):
    """A draft's or a decode's step (one row, one new token, full attention) sees every key
    gathered for it, so the gathering path builds no mask; its answer is flex's (which takes no
    mask) for each row of the cache alone, with and without a soft-cap. A window still masks."""
    cache, tables, starts, _ = filled_cache(heads=4, head_dim=8, seed=0, windowed=False)
    for row in range(3):
        layout = paged_layout([[tables[row]]], [starts[row]], [1], BLOCK, torch.float32, torch.device("cpu"))
        generator = torch.Generator().manual_seed(row)
        query, keys, values = (torch.randn(1, 4, 1, 8, generator=generator) for _ in range(3))
        gather, flex = cache.view(layout), cache.view(layout, kernel="flex")
        assert gather.mask(None) is None and gather.mask(6) is not None
        torch.testing.assert_close(gather.attend(0, query, keys, values, scaling=0.3, softcap=softcap),
                                   flex.attend(0, query, keys, values, scaling=0.3, softcap=softcap),
                                   atol=ATOL, rtol=0)


class HostSyncCounter(TorchDispatchMode):
    """Counts the aten operations that make the host wait for the device: reading a scalar
    (.item(), int(), bool()), and ops whose output size depends on the data (nonzero, boolean-mask
    indexing, masked_select, unique, bincount)."""

    SYNCING = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_dim",
               "unique_consecutive", "bincount", "repeat_interleave")

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        boolean_index = name in ("index", "index_put", "index_put_") and any(
            isinstance(index, torch.Tensor) and index.dtype == torch.bool for index in (args[1] or ()) if index is not None)
        if name in self.SYNCING or boolean_index:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_the_counter_sees_scalar_reads_and_boolean_indexing():
    x = torch.randn(4, 3)
    with HostSyncCounter() as counter:
        int(x.argmax())
        x[x[:, 0] > 0]
        torch.bincount(torch.tensor([1, 2]))
    assert len(counter.seen) == 3, counter.seen


@pytest.mark.parametrize("architecture, lean", [("llama", True), ("llama", False), ("gemma3", False),
                                                ("qwen3_moe", False)])
def test_a_step_forward_makes_the_host_wait_on_nothing(architecture, lean):
    """The forward of a ragged verify step (its layout and view built, the model run) has no
    syncing operation; the runner's one host copy is of the logits it returns."""
    engine = engine_for_model(tiny_model(architecture), lean_forward=lean)
    runner = engine.runner
    histories = {"a": list(range(3, 30)), "b": list(range(40, 49))}
    engine.forward_batch([ForwardCall(seq_id, history, 1) for seq_id, history in histories.items()])
    seen = []
    original = runner._logits

    def counted(*args, **kwargs):
        with HostSyncCounter() as counter:
            logits = original(*args, **kwargs)
        seen.extend(counter.seen)
        return logits

    runner._logits = counted
    engine.forward_batch([ForwardCall("a", histories["a"] + [5, 6, 7], 4), ForwardCall("b", histories["b"] + [9], 2)])
    assert seen == []


def test_the_cuda_graph_ladder_picks_the_smallest_rung_that_holds_the_batch():
    assert graph_batch_size(1) == 1 and graph_batch_size(3) == 4 and graph_batch_size(9) == 16
    assert graph_batch_size(CUDA_GRAPH_BATCH_SIZES[-1]) == CUDA_GRAPH_BATCH_SIZES[-1]
    assert graph_batch_size(CUDA_GRAPH_BATCH_SIZES[-1] + 1) is None   # beyond the ladder: no graph
    assert graph_batch_size(5, ladder=(8, 2)) == 8
    with pytest.raises(ValueError):
        graph_batch_size(0)


def test_under_cuda_graphs_step_batches_are_padded_to_their_rung_and_prefill_chunks_are_not():
    """What the runner hands the forward when CUDA graphs are on (set by hand here, on CPU): a step
    batch (decode, verify, a mix) padded to its rung, rows and kept positions alike, so its shapes
    follow from the rung and its columns alone (cudagraph trees record a graph per new shape), and
    marked graphed; a prefill chunk longer than a step, unpadded and not graphed. The rows
    returned are the unpadded step's, and a graphed step's are a copy."""
    engine, reference = engine_for_model(tiny_model("llama")), engine_for_model(tiny_model("llama"))
    runner = engine.runner
    runner.step_forward.cuda_graphs = True
    seen, outputs = [], []   # (rows, columns, kept, graphed) of each forward; its output's storage
    forward = runner.step_forward.__call__

    def recording(input_ids, view, graphed=False):
        seen.append((*input_ids.shape, view.keep_index.shape[0], graphed))
        out = forward(input_ids, view, graphed=graphed)
        outputs.append(out.untyped_storage().data_ptr())
        return out

    runner.step_forward = type("Recorded", (), {"__call__": staticmethod(recording),
                                                "attention_kernel": "gather", "cuda_graphs": True})()
    prefill = [ForwardCall(name, list(range(3 + 7 * i, 3 + 7 * i + 20 + 3 * i)), 1) for i, name in enumerate("abc")]
    steps = [
        [ForwardCall(call.seq_id, call.token_ids + [5], 1) for call in prefill],                 # decode of 3
        [ForwardCall(call.seq_id, call.token_ids + [5, 6, 7, 8, 9], 5) for call in prefill],     # verify of 3
        [ForwardCall("a", prefill[0].token_ids + [5, 6, 7, 8, 9, 1], 5),                         # mixed
         ForwardCall("b", prefill[1].token_ids + [5, 6], 1)],
    ]
    for calls in [prefill, *steps]:
        rows = engine.forward_batch(calls)
        for got, want in zip(rows, reference.forward_batch(calls)):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        # a graphed step's rows are copied out of the graph's output, which its next replay overwrites
        assert (rows[0].untyped_storage().data_ptr() == outputs[-1]) is not seen[-1][3]
    assert seen[0][3] is False and seen[0][2] == 3                     # the prefill: its 3 kept rows, no graph
    assert seen[1:] == [(4, 1, 4, True), (4, 5, 20, True), (2, 5, 10, True)], seen[1:]


@pytest.mark.parametrize("kernel", ["gather", "flex"])
def test_padding_rows_for_a_graph_leaves_the_real_rows_and_the_cache_alone(kernel):
    """A step padded to a rung (rows repeating row 0) gives the real rows' logits, and the pools
    hold what the unpadded step stores."""
    engine = engine_for_model(tiny_model("llama"))
    runner = engine.runner
    histories = {"a": list(range(3, 20)), "b": list(range(30, 36)), "c": list(range(50, 61))}
    engine.forward_batch([ForwardCall(seq_id, history[:-2], 1) for seq_id, history in histories.items()])
    tables = [[engine.blocks._sequences[seq_id].tables[0] for seq_id in histories]]
    starts = [len(history) - 2 for history in histories.values()]
    layout = paged_layout(tables, starts, [2, 1, 2], runner.block_size, torch.float32, torch.device("cpu"))
    input_ids = torch.tensor([history[-2:] for history in histories.values()])
    input_ids[1, 1] = 0   # b brings one token: a padding column
    keep_index = torch.tensor([0, 1, 2, 4, 5])
    with torch.inference_mode():
        plain = runner._model_logits(input_ids, runner.cache.view(layout, keep_index, kernel))
        stored = [pool.clone() for pool in runner.cache.pools.keys]
        padded_ids, padded = pad_rows(input_ids, layout, 8)
        assert padded_ids.shape == (8, 2) and padded.groups[0].tables.shape[0] == 8
        got = runner._model_logits(padded_ids, runner.cache.view(padded, keep_index, kernel))
        # the kept positions padded too (to rung x columns), as a graphed step's are
        every_kept = runner._model_logits(padded_ids, runner.cache.view(padded, pad_kept(keep_index, 16), kernel))
    torch.testing.assert_close(got, plain, atol=ATOL, rtol=0)
    assert every_kept.shape[0] == 16
    torch.testing.assert_close(every_kept[:5], plain, atol=ATOL, rtol=0)
    for before, after in zip(stored, runner.cache.pools.keys):
        torch.testing.assert_close(after, before, atol=ATOL, rtol=0)
