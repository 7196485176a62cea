"""The engines' model runner: one forward over a fully planned batch of many sequences, over a
paged KV cache, for any decoder.

The runner does not allocate: the scheduler's block manager (decoding.block_manager) plans each
forward as a `StepPlan` (per row the tokens to run, where they start, its block table in every KV
cache group, copy-on-write copies to make first) and `run` runs it: right-padded input ids,
per-row position ids and the kept positions as an index (no boolean mask: selecting by one
would wait on the host) built from the plan (decoding.paged_cache.paged_layout), keys and values
in blocks of a budgeted pool, so only the rows asked for reach the LM head. The model runs its own forward, whatever its architecture (q/k norms, fused projections,
MoE, soft-capping, sliding windows per layer): its attention is decoding.paged_attention's,
registered in transformers' AttentionInterface, as vLLM's Transformers backend does. For
full-attention Llama-shaped models decoding.lean_forward runs the same attention with less Python
per step (docs/performance.md has the measurement that keeps it).

A model this path cannot serve (encoder-decoder, a layer that does not attend through the
interface, e.g. recurrent or linear attention) is refused at load with UnsupportedModelError
naming what is unsupported; there is no slower fallback.

Sliding-window layers are KV cache groups of their own (decoding.paged_cache.KVGroup, read from the
window each layer passes to the attention in a probe forward at load): the block manager keeps a
table per group and lets a windowed group's blocks outside its window go (docs/kv-memory.md).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from specserve.decoding.block_manager import StepPlan
from specserve.decoding.model_runner import RunnerBase, load_causal_lm, model_path_of
from specserve.decoding.compiled_forward import CompiledForward, graph_batch_size, pad_kept, pad_rows
from specserve.decoding.lean_forward import LeanDecoder, lean_support
from specserve.decoding.null_forward import allowed_tokens, null_logits
from specserve.decoding.checkpoint import resolve_device
from specserve.decoding.device_copy import host_to_device, index_on
from specserve.decoding.eagle3_head import aux_features
from specserve.decoding.host_memory import keep_freed_memory
from specserve.decoding.target_features import TargetFeatures
from specserve.decoding.tensor_parallel import TensorParallelRank, agreed_minimum, in_group, join_group, weight_bytes
from specserve.decoding.paged_attention import ATTENTION_NAME, FLASH_BLOCK_SIZE, PagedAttentionError, flash_kernel_available
from specserve.decoding.weight_layout import input_major_linears, pack_linears, repack_linears
from specserve.decoding.token_map import load_token_map, map_lm_head, mapped_head, remap_heads, served_token_map
from specserve.decoding.paged_attention import register as register_paged_attention
from specserve.decoding.paged_cache import (
    DEFAULT_BLOCK_SIZE,
    GIB,
    KVCapacity,
    KVGroup,
    PagedKVCache,
    blocks_for,
    gpu_kv_budget_bytes,
    kv_capacity,
    step_peak_bytes,
    kv_groups,
    paged_layout,
)

__all__ = ["BatchedModelRunner", "UnsupportedModelError", "decoder_support", "load_runner",
           "runner_for_model"]

logger = logging.getLogger(__name__)
# KV budget per engine on CPU when none is given: vLLM's CPU default (VLLM_CPU_KVCACHE_SPACE). The
# pool grows with use, so an engine holding few tokens holds little of it.
DEFAULT_KV_CACHE_MEMORY_GB = 4.0
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
# The largest forwards an engine plans with the default batching settings: a step batch of
# max_batch_rows rows of up to max_step_tokens, and one prefill chunk of prefill_token_budget.
DEFAULT_PROFILE_BATCHES = ((64, 16), (1, 2048))
# How far back from its end a later call may crop a sequence and still find its windowed layers'
# keys (the engine's max_step_tokens default: a verify step's speculative tail); deeper, it recomputes.
DEFAULT_ROLLBACK_TOKENS = 16
# The (rows, new tokens a row) the compiled forward is traced for at start: a single stream's
# decode step and longer step (verify, prefill), and a batch's; shapes of 1 specialize in
# flex_attention and the stores, so each traces apart (decoding.compiled_forward).
WARM_UP_SHAPES = ((1, 1), (1, 2), (2, 1), (2, 2))


def kept_per_row(tokens: int, rollback_tokens: int) -> int:
    """How many of a row's `tokens` new tokens a planned step keeps logits for: in a step batch
    (tokens up to rollback_tokens, the engine's max_step_tokens) every one, as a verify does; in a
    longer step, a prefill chunk, its last."""
    return tokens if tokens <= rollback_tokens else 1


class UnsupportedModelError(ValueError):
    """The model is not a decoder whose every layer attends through transformers' attention
    interface, so the paged engine cannot serve it (raised at load, naming what is unsupported)."""


class BatchedModelRunner(RunnerBase):
    """Owns one model and its paged KV pools; `run` runs a planned forward of many sequences."""

    def _init_from_model(self, model, max_sequences: int, model_path: str, lean: bool = True,
                         max_model_len: int | None = None, kv_cache_memory_gb: float | None = None,
                         gpu_memory_utilization: float | None = None,
                         block_size: int = DEFAULT_BLOCK_SIZE, gpu_share: float = 1.0,
                         profile_batches: Sequence[tuple[int, int]] = DEFAULT_PROFILE_BATCHES,
                         prefix_caching: bool = True, cache_salt: str | None = None,
                         rollback_tokens: int = DEFAULT_ROLLBACK_TOKENS, enforce_eager: bool | None = None,
                         aux_layers: Sequence[int] = (), null_forward_agreement: float | None = None,
                         inductor_options: dict | None = None) -> None:
        """enforce_eager: True runs the forward uncompiled, False compiles it, None compiles on CUDA
        only (and not where SPECSERVE_ENFORCE_EAGER=1; decoding.compiled_forward.CompiledForward);
        inductor_options: inductor's settings for every compile of the forward.
        lean: run decoding.lean_forward where the architecture has one (else transformers' forward).
        max_model_len: longest sequence served (default: the model's max_position_embeddings).
        kv_cache_memory_gb: the KV budget on CPU; on CUDA, gpu_memory_utilization of the engine's
        gpu_share of the device, less the weights and the peak activations of the largest forwards
        (profile_batches: (rows, new tokens) the scheduler can plan) decide it (gpu_kv_budget_bytes),
        as vLLM's two settings do.
        prefix_caching: full blocks stay findable by their tokens after their sequence lets go of
        them, and a sequence starts from the longest cached prefix (docs/kv-memory.md).
        cache_salt: what besides the tokens decides the keys and values (default: model_path; a
        draft engine adds the version it serves), the root of every block's hash chain.
        rollback_tokens: how far back from its end a later call may crop a sequence and still find
        its sliding-window layers' keys (the engine's max_step_tokens); a deeper crop recomputes.
        aux_layers: the layers whose inputs an EAGLE-3 head reads (docs/eagle3.md): every forward
        stores them in the KV pool beside its tokens' keys (PagedKVCache.store_features), read
        with `features`; a prefix-cache hit finds the features of the positions it reuses there,
        since the head needs every committed position's. Empty, the forward computes none.
        null_forward_agreement: for benches of the stack, the model call returns the rule's logits
        (decoding.null_forward) predicting its reference token at this rate, instead of computing."""
        supported, reason = decoder_support(model)
        if not supported:
            raise UnsupportedModelError(f"{model_path}: specserve's engine cannot serve this model: {reason}")
        super()._init_from_model(model, max_sequences, model_path, max_model_len)
        register_paged_attention()
        try:
            model.set_attn_implementation(ATTENTION_NAME)
        except (ValueError, KeyError) as error:   # transformers refuses a custom attention for it
            raise UnsupportedModelError(f"{model_path}: its attention cannot be replaced: {error}") from error
        self._dtype = next(model.parameters()).dtype
        input_major_linears(model)
        pack_linears(model)
        if self.device.type == "cpu":
            keep_freed_memory()   # each step's tensors on pages already mapped (decoding/host_memory.py)
        self.mapped_head = mapped_head(model)   # a draft's LM head over a token map: told each step's rows
        self.aux_layers = tuple(int(layer) for layer in aux_layers)
        num_layers = self.config.num_hidden_layers
        if not all(0 <= layer < num_layers for layer in self.aux_layers):
            raise ValueError(f"{model_path}: aux_layers {list(self.aux_layers)} must be layers of its {num_layers}")
        flash = flash_kernel_available(self.device)
        if flash:
            block_size = FLASH_BLOCK_SIZE
        elif self.device.type == "cuda":
            logger.warning("%s: flash-attn with a paged kernel is not installed: attention gathers each sequence's "
                           "blocks per layer (the CPU path); install flash-attn for the paged kernel", model_path)
        self.lean = LeanDecoder(model, self.aux_layers, self.max_context) if lean and lean_support(model)[0] else None
        decoder = model.get_decoder()
        if self.lean is None and not getattr(decoder, "_specserve_keeps_rows", False):
            # The model's own forward: its decoder's output narrowed to the kept rows (once per model).
            decoder.register_forward_hook(_keep_rows, with_kwargs=True)
            decoder._specserve_keeps_rows = True
        self.null_forward_agreement = None   # the start-up checks and the pools' shaping run the model
        self._null_allowed: tuple[tuple, torch.Tensor | None] = ((), None)   # (vocab size, EOS ids) -> allowed ids
        self.step_forward = CompiledForward(self._model_logits, self.device, enforce_eager, inductor_options)
        # One rank of a tensor-parallel group (decoding.tensor_parallel): its pool holds its heads.
        self.tensor_parallel_size = int(getattr(model, "tp_size", None) or 1)
        self.rollback_tokens = rollback_tokens
        groups = kv_groups(self._layer_windows(block_size, flash))
        if self.device.type == "cuda":
            # This engine's own weights, not what the process holds: another runner's weights and
            # pool on the same device are paid from that runner's share.
            budget = gpu_kv_budget_bytes(torch.cuda.get_device_properties(self.device).total_memory,
                                         gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION, gpu_share,
                                         weight_bytes(model),
                                         max(self._peak_activation_bytes(rows, tokens, block_size, flash, groups)
                                             for rows, tokens in profile_batches))
        else:
            budget = (kv_cache_memory_gb or DEFAULT_KV_CACHE_MEMORY_GB) * GIB
        # Every rank budgets for the features (its pool holds the same blocks), though only the
        # rank that answers (rank 0) stores them.
        feature_size = len(self.aux_layers) * int(self.config.hidden_size)
        self.kv_capacity: KVCapacity = kv_capacity(
            self.config, self._dtype, budget, self.max_context, block_size, self.tensor_parallel_size, groups,
            rollback_tokens, new_tokens=max(tokens for _, tokens in profile_batches),
            feature_bytes_per_token=feature_size * self._dtype.itemsize)
        if self.tensor_parallel_size > 1:   # every rank's pool must hold the same blocks
            self.kv_capacity = replace(self.kv_capacity, num_blocks=agreed_minimum(self.kv_capacity.num_blocks))
        try:
            self.cache = PagedKVCache(num_layers=self.config.num_hidden_layers, num_blocks=self.kv_capacity.num_blocks,
                                      block_size=block_size, device=self.device, flash=flash, groups=groups,
                                      feature_size=feature_size)
        except ValueError as error:
            raise UnsupportedModelError(f"{model_path}: cannot serve an EAGLE-3 head: {error}") from error
        # What the block manager over this pool is built with (decoding.block_manager.BlockManager.for_runner).
        self.prefix_caching = prefix_caching
        self.cache_salt = cache_salt or model_path
        # A forward over the cache shapes every pool: on CUDA the whole budget is allocated here,
        # so an out-of-memory shows at start, not on the first request. Then the forward is
        # compiled (over shaped pools: a graph traced before them would not be reused).
        self._dummy_forward(self.cache, rows=1, tokens=1, eager=True)
        self.null_forward_agreement = null_forward_agreement
        self.step_forward.warm_up(lambda: [self._dummy_forward(self.cache, rows, tokens, over_map=over_map)
                                           for over_map in self._head_modes()
                                           for rows, tokens in self._warm_up_shapes()], model_path)

    def _head_modes(self) -> tuple[bool, ...]:
        """The steps' `over_map` values whose forwards differ: both for a head over a token map that
        scores only the steps that may be (each compiles its own graph), else one."""
        return (True, False) if self.mapped_head is not None and not self.mapped_head.maps_sampled else (False,)

    def _score_rows(self, over_map: bool) -> None:
        """Tell a head over a token map whether the next forward's rows may be scored over it."""
        if self.mapped_head is not None:
            self.mapped_head.for_step(over_map)

    def _warm_up_shapes(self) -> tuple[tuple[int, int], ...]:
        """WARM_UP_SHAPES, and under CUDA graphs a step longer than a graphed one, which the
        forward compiled without graphs serves (a prefill chunk)."""
        if not self.step_forward.cuda_graphs:
            return WARM_UP_SHAPES
        return (*WARM_UP_SHAPES, (1, self.rollback_tokens + 1))

    def _peak_activation_bytes(self, rows: int, tokens: int, block_size: int, flash: bool,
                               groups: Sequence[KVGroup]) -> int:
        """CUDA only (never run here: no GPU): device memory a step of rows x tokens new tokens
        takes at its peak beyond its keys and values (step_peak_bytes), measured on a throw-away
        cache, as vLLM profiles a dummy batch before sizing its KV cache. A step batch (tokens up
        to rollback_tokens, the engine's max_step_tokens) keeps every row, as a batch of verifies
        does; a prefill chunk keeps its last. Measured from what the device holds before it, so
        another runner's pool in this process is not counted as this one's activations."""
        scratch = PagedKVCache(num_layers=self.config.num_hidden_layers,
                               num_blocks=len(groups) * rows * blocks_for(tokens, block_size), block_size=block_size,
                               device=self.device, flash=flash, groups=groups)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        kept = kept_per_row(tokens, self.rollback_tokens)
        self._dummy_forward(scratch, rows, tokens, kept, eager=True)
        peak = torch.cuda.max_memory_allocated(self.device) - before - scratch.reserved_bytes()
        del scratch
        torch.cuda.empty_cache()
        return step_peak_bytes(max(0, peak), rows * kept, self.vocab_size)

    def _layer_windows(self, block_size: int, flash: bool) -> list[int | None]:
        """One 1-token forward at load over a one-block scratch cache: every layer must have stored
        its keys through the paged attention, else the model keeps state of its own (recurrent or
        linear-attention layers) that rollback and batching would silently get wrong; -> the
        sliding window each layer passed (None: full attention, as is a window the context never
        outgrows), which decides the KV cache groups. Read from the forward, not the config: every
        architecture names its windows its own way, and this is what attention will be asked."""
        num_layers = self.config.num_hidden_layers
        probe = PagedKVCache(num_layers=num_layers, num_blocks=1, block_size=block_size, device=self.device,
                             flash=flash)
        try:
            view = self._dummy_forward(probe, rows=1, tokens=1, eager=True)
        except PagedAttentionError as error:
            raise UnsupportedModelError(f"{self.model_path}: {error}") from error
        missing = sorted(set(range(num_layers)) - view.windows.keys())
        if missing:
            raise UnsupportedModelError(
                f"{self.model_path}: layers {missing} of {num_layers} do not attend through "
                "transformers' attention interface (recurrent or linear-attention layers?); specserve's engine "
                "cannot serve this model")
        return [None if window is None or window >= self.max_context else int(window)
                for window in (view.windows[layer] for layer in range(num_layers))]

    @torch.inference_mode()   # as a step's forward: a compiled graph guards on its inputs' mode
    def _dummy_forward(self, cache: PagedKVCache, rows: int, tokens: int, kept: int = 1, eager: bool = False,
                       over_map: bool = False):
        """One forward of rows new sequences of `tokens` tokens over distinct blocks of `cache`
        (nothing else holds them: at load, or a throw-away cache), keeping each row's last `kept`
        logits (eager: without compiling); -> its PagedBatchView (which layers attended through it)."""
        per_table = blocks_for(tokens, cache.block_size)
        cache.reserve(len(cache.groups) * rows * per_table)
        ids = iter(range(len(cache.groups) * rows * per_table))
        tables = [[[next(ids) for _ in range(per_table)] for _ in range(rows)] for _ in cache.groups]
        layout = paged_layout(tables, [0] * rows, [tokens] * rows, cache.block_size, dtype=self._dtype,
                              device=self.device)
        keep_index = ((torch.arange(rows, device=self.device) * tokens).unsqueeze(1)
                      + torch.arange(tokens - kept, tokens, device=self.device)).reshape(-1)
        kernel = "gather" if eager else self.step_forward.attention_kernel
        view = cache.view(layout, keep_index, kernel)
        input_ids = torch.zeros((rows, tokens), dtype=torch.long, device=self.device)
        self._score_rows(over_map)
        if eager:
            self._model_logits(input_ids, view)
        else:
            self._logits(input_ids, layout, keep_index, view)
        return view

    def run(self, plan: StepPlan, want_logits: bool = True) -> list[torch.Tensor]:
        """One model forward over a planned step (decoding.block_manager.StepPlan): the pools grow
        to the plan's blocks, its copy-on-write copies are made, then every row's tokens run at its
        positions through its tables; -> per row, float32 logits [num_rows, V] of its last
        num_rows tokens. want_logits False (a tensor-parallel follower, which answers nothing):
        the forward runs, the logits are neither converted nor split."""
        return self._run(plan, want_logits)

    def features(self, table: Sequence[int], start: int, end: int) -> TargetFeatures:
        """The aux_layers' features of positions start..end-1 of the sequence whose block table
        (in the cache's feature_group) is `table`, as the forwards that computed them stored them."""
        if not self.aux_layers:
            raise ValueError(f"{self.model_path}: this runner was built without aux_layers; it computes no features")
        return TargetFeatures(start, self.cache.read_features(table, start, end))

    @torch.inference_mode()   # the layout too: a compiled graph guards on its inputs' mode
    def _run(self, plan: StepPlan, want_logits: bool) -> list[torch.Tensor]:
        self.cache.reserve(plan.pool_blocks)
        for source, destination in plan.copies:
            self.cache.copy_block(source, destination)
        self._score_rows(plan.over_map)
        num_new = [len(ids) for ids in plan.input_ids]
        layout = paged_layout(plan.group_tables, plan.starts, num_new, self.block_size, dtype=self._dtype,
                              device=self.device)
        num_columns = max(num_new)
        # Padding id 0 is never stored nor seen by a real token; its rows are not kept.
        input_ids = torch.tensor([list(ids) + [0] * (num_columns - len(ids)) for ids in plan.input_ids],
                                 dtype=torch.long)
        keep_index = index_on([b * num_columns + t for b, (rows, n) in enumerate(zip(plan.num_rows, num_new))
                               for t in range(n - rows, n)], self.device)
        logits = self._logits(host_to_device(input_ids, self.device), layout, keep_index)
        if self.aux_layers:
            logits, hidden = logits
            if want_logits:   # the answering rank (a tensor-parallel follower answers nothing)
                self.cache.store_features(layout, hidden)
        if not want_logits:
            return []
        # keep_index lists the kept rows in (row, column) order.
        return list(self._served_columns(logits.float()).split(list(plan.num_rows)))

    @torch.inference_mode()
    def _logits(self, input_ids: torch.Tensor, layout, keep_index: torch.Tensor, view=None):
        """The model's logits for the kept positions (keep_index: flat b * T + t), in that
        order: [kept, V] (with aux_layers, and the features of every position); compiled unless
        enforce_eager (decoding.compiled_forward). Under CUDA graphs a step batch (at most
        rollback_tokens new tokens a row, as decode and verify steps are) is padded to a rung of
        the ladder, rows and kept positions alike, so that its shapes are the rung's; a longer
        step (a prefill chunk) and a batch beyond the ladder run without a graph. `view` given:
        a warm-up's own, unpadded."""
        kept = keep_index.shape[0]
        graphed = self.step_forward.cuda_graphs and input_ids.shape[1] <= self.rollback_tokens
        if view is None:
            rows = graph_batch_size(input_ids.shape[0]) if graphed else None
            if rows is not None:   # a rung of the CUDA-graph ladder
                input_ids, layout = pad_rows(input_ids, layout, rows)
                keep_index = pad_kept(keep_index, rows * input_ids.shape[1])
            graphed = rows is not None
            view = self.cache.view(layout, keep_index, self.step_forward.attention_kernel)
        out = self.step_forward(input_ids, view, graphed=graphed)
        logits, features = out if isinstance(out, tuple) else (out, None)
        logits = logits[:kept]
        if graphed:   # a graph's outputs live in its memory pool, which its next replay overwrites
            logits = logits.clone()
        # (the features, read by the layout's write_source, are stored before any next forward)
        return logits if features is None else (logits, features)

    def _model_logits(self, input_ids: torch.Tensor, view):
        """The forward that is compiled: the lean forward, or the model's own. The model keeps no
        cache of its own (use_cache=False): its attention stores keys and values in the paged view
        it receives as a keyword (decoding.paged_attention), and its decoder's output is narrowed
        to the kept positions before the LM head (`_keep_rows`). With aux_layers: (logits, the
        aux layers' inputs at every position [B * T, len(aux_layers) x hidden])."""
        if self.null_forward_agreement is not None:
            return self._null_logits(input_ids, view)
        if self.lean is not None:
            return self.lean.forward(input_ids, view.layout.position_ids, view)
        output = self.model(input_ids=input_ids, position_ids=view.layout.position_ids, use_cache=False,
                            logits_to_keep=0, paged_batch=view, output_hidden_states=bool(self.aux_layers))
        if not self.aux_layers:
            return output.logits[0]
        hidden = aux_features(output.hidden_states, self.aux_layers)
        return output.logits[0], hidden.reshape(-1, hidden.shape[-1])

    def _null_logits(self, input_ids: torch.Tensor, view) -> torch.Tensor:
        """decoding.null_forward's logits for the kept positions, over the vocabulary and EOS served now."""
        key = (self.vocab_size, self.eos_token_ids)
        if self._null_allowed[0] != key:   # serve_as may change them after the warm-up
            self._null_allowed = key, allowed_tokens(*key).to(self.device)
        kept = view.keep_index
        return null_logits(input_ids.reshape(-1).index_select(0, kept),
                           view.layout.position_ids.reshape(-1).index_select(0, kept),
                           self._null_allowed[1], self.null_forward_agreement, self.vocab_size)

    def weights_mismatch(self, state: Mapping[str, torch.Tensor]) -> str | None:
        """Why `state` cannot replace this runner's weights in place (None: it can): it must name
        exactly this model's weights, each of the same shape."""
        own = self.model.state_dict()
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            return (f"the new weights are not this draft's architecture: missing {missing[:3]}, "
                    f"unexpected {unexpected[:3]}")
        shapes = [name for name, tensor in own.items() if tuple(state[name].shape) != tuple(tensor.shape)]
        if shapes:
            return f"the new weights are not this draft's shapes: {shapes[:3]} differ"
        return None

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Serve `state` (weights of this same architecture, e.g. a trained draft version) from the
        next forward, copied into the model's own tensors: the KV pool and the weights' memory are
        the ones already serving, so on a GPU a swap needs no room for a second copy of either.
        The keys and values held belong to the old weights: the block manager lets them go
        (BlockManager.reset). ValueError (nothing changed) when `weights_mismatch` says why it cannot."""
        problem = self.weights_mismatch(state)
        if problem is not None:
            raise ValueError(problem)
        with torch.no_grad():
            self.model.load_state_dict(state, strict=True)
        repack_linears(self.model)
        remap_heads(self.model)

    @property
    def block_size(self) -> int:
        return self.cache.block_size

def _keep_rows(decoder, args, kwargs, output):
    """Forward hook on the model's decoder: its last hidden states [B, T, H] narrowed to the
    positions the paged view's keep_index names, [1, kept, H], so the model's own head (and
    whatever it applies to logits: soft-caps, scales) runs only over them, and no boolean mask
    (a host sync) selects them."""
    view = kwargs.get("paged_batch")
    if view is None or view.keep_index is None:
        return None
    hidden = output.last_hidden_state
    output.last_hidden_state = hidden.reshape(-1, hidden.shape[-1]).index_select(0, view.keep_index).unsqueeze(0)
    return output



def decoder_support(model) -> tuple[bool, str]:
    """(True, why) when the model is a decoder the paged engine can run, else (False, why not),
    from what can be read before a forward: a causal decoder whose forward takes logits_to_keep.
    Whether every layer attends through the interface is checked by a forward at load."""
    config = model.config.get_text_config(decoder=True)
    model_type = getattr(config, "model_type", None)
    if getattr(model.config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
        return False, f"{model_type!r} is an encoder-decoder (cross-attention needs an encoder cache)"
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return False, f"{type(model).__name__}.forward takes no logits_to_keep"
    return True, f"{model_type} decoder"


def runner_for_model(model, max_sequences: int = 256, model_path: str | None = None,
                     lean_forward: bool = True, max_model_len: int | None = None,
                     kv_cache_memory_gb: float | None = None,
                     gpu_memory_utilization: float | None = None, gpu_share: float = 1.0,
                     profile_batches: Sequence[tuple[int, int]] = DEFAULT_PROFILE_BATCHES,
                     prefix_caching: bool = True, cache_salt: str | None = None,
                     rollback_tokens: int = DEFAULT_ROLLBACK_TOKENS,
                     enforce_eager: bool | None = None, aux_layers: Sequence[int] = (),
                     null_forward_agreement: float | None = None,
                     inductor_options: dict | None = None) -> BatchedModelRunner:
    """BatchedModelRunner over `model` (running the lean forward where the architecture has one and
    lean_forward is set); logs one line saying which forward, the KV capacity and whether prefix
    caching is on (see BatchedModelRunner._init_from_model). UnsupportedModelError for a model it
    cannot serve."""
    path = model_path or model_path_of(model)
    lean, lean_reason = lean_support(model) if lean_forward else (False, "lean_forward is off")
    runner = BatchedModelRunner.__new__(BatchedModelRunner)
    runner._init_from_model(model, max_sequences=max_sequences, model_path=path, lean=lean,
                            max_model_len=max_model_len, kv_cache_memory_gb=kv_cache_memory_gb,
                            gpu_memory_utilization=gpu_memory_utilization, gpu_share=gpu_share,
                            profile_batches=profile_batches, prefix_caching=prefix_caching, cache_salt=cache_salt,
                            rollback_tokens=rollback_tokens, enforce_eager=enforce_eager, aux_layers=aux_layers,
                            null_forward_agreement=null_forward_agreement, inductor_options=inductor_options)
    group = "" if runner.tensor_parallel_size == 1 else (
        f"tensor-parallel rank {torch.distributed.get_rank()} of {runner.tensor_parallel_size}: "
        f"{weight_bytes(model) / 2 ** 20:,.1f} MiB of weights; ")
    logger.info("%s: batched paged-KV runner (%s; %s; %s); %s%s; prefix caching %s", path, decoder_support(model)[1],
                (f"NULL forward, agreement {null_forward_agreement} (a bench of the stack: no model is computed)"
                 if null_forward_agreement is not None else
                 lean_reason if lean else f"transformers forward: {lean_reason}"), runner.step_forward.describe(), group,
                runner.kv_capacity.describe(), "on" if runner.prefix_caching else "off")
    return runner


def load_runner(spec: dict):
    """The runner for a model spec mapping (path, dtype, device, torch_threads, max_sequences,
    lean_forward, and optionally max_model_len, kv_cache_memory_gb, gpu_memory_utilization,
    prefix_caching, cache_salt, aux_layers (an EAGLE-3 head's target), token_map and token_map_sampled
    (a draft's: its LM head scores only those tokens, in greedy steps or in all; auto: its folder's
    map, decoding.token_map.served_token_map; the builder gives a target None),
    and the builder's gpu_share, profile_batches and rollback_tokens: see
    BatchedModelRunner._init_from_model).

    With `tensor_parallel` ({rank, size, store_address}: this process is one rank of a group) it
    joins the group and loads this rank's shards; rank 0 gets the MirroredRunner the engine
    drives, a follower the Follower that replays its calls (decoding.tensor_parallel)."""
    member = spec.get("tensor_parallel")
    group = None if member is None else TensorParallelRank(**member)
    control = None if group is None else join_group(group, resolve_device(spec["device"]))
    model = load_causal_lm(spec["path"], dtype=spec["dtype"], device=spec["device"],
                           num_threads=spec["torch_threads"], tensor_parallel_size=group.size if group else 1)
    token_map = served_token_map(spec.get("token_map"), spec["path"], drafts=group is None)
    if token_map:
        token_ids = load_token_map(token_map, model.get_output_embeddings().out_features)
        map_lm_head(model, token_ids, maps_sampled=spec.get("token_map_sampled", False))
        logger.info("%s: the LM head scores the %d tokens of the token map %s in %s", spec["path"], len(token_ids),
                    token_map, "every step" if spec.get("token_map_sampled") else "greedy steps")
    runner = runner_for_model(model, max_sequences=spec["max_sequences"], model_path=spec["path"],
                              lean_forward=spec.get("lean_forward", True), max_model_len=spec.get("max_model_len"),
                              kv_cache_memory_gb=spec.get("kv_cache_memory_gb"),
                              gpu_memory_utilization=spec.get("gpu_memory_utilization"),
                              gpu_share=spec.get("gpu_share", 1.0),
                              profile_batches=[tuple(batch) for batch in spec.get("profile_batches", DEFAULT_PROFILE_BATCHES)],
                              prefix_caching=spec.get("prefix_caching", True), cache_salt=spec.get("cache_salt"),
                              rollback_tokens=spec.get("rollback_tokens", DEFAULT_ROLLBACK_TOKENS),
                              enforce_eager=spec.get("enforce_eager"), aux_layers=spec.get("aux_layers", ()),
                              null_forward_agreement=spec.get("null_forward_agreement"),
                              inductor_options=spec.get("inductor_options"))
    runner.serve_as(spec.get("vocab_size"), spec.get("eos_token_ids"))
    return runner if group is None else in_group(runner, group.rank, control)
