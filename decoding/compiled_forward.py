"""The engine's forward compiled: torch.compile of the model's forward, its on-disk cache, and the
CUDA-graph batch ladder.

Why: eager PyTorch pays Python and op dispatch for every kernel, tens per layer, every draft step
and every verify; for a small draft that overhead is most of a step, and on a GPU the launches
outrun the arithmetic. torch.compile traces the forward once (the lean forward or the model's own,
through the attention interface, as vLLM's Transformers backend compiles Hugging Face modules) into
fused kernels, dynamic in the number of rows, new tokens and cached tokens, so one graph serves
every step. On CUDA the compiled forward runs under CUDA graphs (inductor's cudagraph trees,
which record a graph for every new set of shapes): a step batch's rows and kept positions are
padded up to the next rung of a ladder of batch sizes (`graph_batch_size`, `pad_rows`,
`pad_kept`), so its shapes follow from the rung and its columns; a prefill chunk and a batch
beyond the ladder run the same forward compiled without graphs.

Compiling costs start-up time, paid once per machine: inductor's artifacts are cached on disk
under the specserve cache directory (`compile_cache_dir`), so a restart reuses them (figures in
docs/performance.md). `enforce_eager` (vLLM's name) turns compilation off. A forward inductor
cannot generate kernels for is compiled again with its loop-rewriting fusions off
(`PLAIN_FUSION`), one that fails otherwise under CUDA graphs is compiled without them, and one that
still fails serves eager, each with one warning naming why (`CompiledForward.warm_up`).
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
import torch._dynamo
import torch.fx.experimental._config

from specserve.decoding.cache_dir import specserve_cache_dir

logger = logging.getLogger(__name__)

# Set (to 1) where runners should not compile unless asked: the test suite, whose hundreds of
# runners would each pay a compile (docs/testing.md).
ENFORCE_EAGER_ENV = "SPECSERVE_ENFORCE_EAGER"
# Batch sizes CUDA graphs are captured for (vLLM's ladder starts 1, 2, 4, 8 and then steps by 8).
CUDA_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)
# Graphs dynamo keeps per function before it gives up compiling it (its own default is 8).
RECOMPILE_LIMIT = 64
# Inductor's fusions that fit a node into a kernel whose loops are not its own: rewriting its loops
# (reorder, reindex, reductions over different dimensions) or fusing pointwise work into a
# template's kernel (flex_attention's, a matmul's) as its prologue or epilogue. With dynamic sizes
# such a kernel can ask codegen to split a range by one it cannot prove divides it (docs/gpu.md),
# and the forward fails to compile. The retry after a code-generation failure turns them off,
# keeping the plain fusions; the names a given torch does not have are left out.
PLAIN_FUSION = {"loop_ordering_after_fusion": False, "loop_reindexing_after_fusion": False,
                "triton.mix_order_reduction": False, "prologue_fusion": False, "epilogue_fusion": False}


def compile_cache_dir() -> Path:
    """Where inductor keeps compiled artifacts: $TORCHINDUCTOR_CACHE_DIR where the user chose it,
    else <specserve cache>/inductor, the specserve cache being $SPECSERVE_CACHE_DIR or
    $XDG_CACHE_HOME/specserve (~/.cache/specserve). Sets TORCHINDUCTOR_CACHE_DIR, which inductor
    reads whenever it looks for its cache. A value equal to inductor's own default (a folder under
    /tmp) counts as unset: inductor writes its default into the environment the first time
    anything asks for its cache, and loading a checkpoint through transformers does, before any
    runner compiles."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not chosen or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(specserve_cache_dir() / "inductor")
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def eager_by_default() -> bool:
    """True where ENFORCE_EAGER_ENV asks runners not to compile (the tests)."""
    return os.environ.get(ENFORCE_EAGER_ENV, "").strip().lower() in ("1", "true", "yes")


def plain_fusion_options() -> dict[str, bool]:
    """PLAIN_FUSION less the settings this torch's inductor does not have (torch.compile
    rejects unknown ones)."""
    import torch._inductor.config as inductor_config

    def known(name: str) -> bool:
        owner = inductor_config
        *parents, leaf = name.split(".")
        for parent in parents:
            owner = getattr(owner, parent, None)
        return owner is not None and hasattr(owner, leaf)

    return {name: value for name, value in PLAIN_FUSION.items() if known(name)}


def code_generation_failed(failure: str) -> bool:
    """Whether a compile failure (CompiledForward's one line) is inductor failing to lower or
    generate the graph's kernels: that comes of the kernels' fusion, not of CUDA graphs, and
    compiling again without graphs only meets it again (minutes for a large model)."""
    return failure.startswith("InductorError")


def graph_batch_size(rows: int, ladder: Sequence[int] = CUDA_GRAPH_BATCH_SIZES) -> int | None:
    """The smallest rung of the ladder that holds rows (the batch a CUDA graph was captured for),
    or None beyond the ladder: that step runs without a graph."""
    if rows < 1:
        raise ValueError(f"a step has at least one row, got {rows}")
    return next((size for size in sorted(ladder) if size >= rows), None)


def pad_kept(keep_index: torch.Tensor, total: int) -> torch.Tensor:
    """keep_index (the kept positions, flat b * T + t) padded to `total` entries by repeating its
    first: a captured graph's shapes must follow from its rung and its columns alone, and how many
    positions a step keeps varies with its real rows (the caller drops the padding's logits)."""
    extra = total - keep_index.shape[0]
    if extra < 0:
        raise ValueError(f"cannot pad {keep_index.shape[0]} kept positions down to {total}")
    return keep_index if extra == 0 else torch.cat([keep_index, keep_index[:1].expand(extra)])


def pad_rows(input_ids: torch.Tensor, layout, rows: int):
    """(input_ids, layout) of a step padded from B to `rows` rows for a captured graph. A padding
    row repeats row 0 (its tokens, positions, tables and token slots), and its stores take row
    0's own keys (write_source), so it writes exactly what row 0 writes; the kept positions
    (keep_index, flat b * T + t) are the real rows', so none of it reaches the LM head."""
    from dataclasses import replace

    batch, columns = input_ids.shape
    extra = rows - batch
    if extra < 0:
        raise ValueError(f"cannot pad {batch} rows down to {rows}")
    if extra == 0:
        return input_ids, layout

    def repeat_first(tensor: torch.Tensor, width: int = 1) -> torch.Tensor:
        """tensor's first row (its first `width` entries, flat) repeated for the padding rows."""
        first = tensor[:width] if width > 1 else tensor[:1]
        return torch.cat([tensor, first.repeat(extra, *([1] * (tensor.dim() - 1)))])

    groups = tuple(replace(group, tables=repeat_first(group.tables),
                           write_slots=repeat_first(group.write_slots, columns)) for group in layout.groups)
    padded = replace(layout, groups=groups, position_ids=repeat_first(layout.position_ids),
                     num_new=repeat_first(layout.num_new), write_source=repeat_first(layout.write_source, columns))
    return repeat_first(input_ids), padded


class CompiledForward:
    """`forward(input_ids, view) -> logits` compiled with torch.compile (dynamic shapes), falling
    back to the eager function when compiling fails at warm-up. `eager` says which one runs and
    `reason` why. enforce_eager True keeps it eager and False compiles; None (the default) compiles
    on CUDA only, unless ENFORCE_EAGER_ENV is set in the process (and so in the Ray workers it
    starts). Why not on a CPU by default: there compiling buys little per step and costs minutes
    of start-up per model on a cold cache (docs/performance.md), which a server that should answer
    its first request soon does not pay unless asked."""

    def __init__(self, forward: Callable, device: torch.device, enforce_eager: bool | None = None,
                 inductor_options: Mapping[str, object] | None = None, cuda_graphs: bool = True) -> None:
        """cuda_graphs False: on CUDA too, compiled without graphs only (for a caller that pads
        nothing to the ladder's rungs)."""
        self.eager_forward = forward
        self.graphs_asked = cuda_graphs
        # Inductor's settings for every compile of this forward (torch.compile's options; vLLM's
        # inductor_compile_config), under the ones this object sets itself.
        self.inductor_options = dict(inductor_options or {})
        self.device = torch.device(device)
        if enforce_eager is not None:
            self.eager, self.reason = enforce_eager, "enforce_eager" if enforce_eager else "compiled"
        elif eager_by_default():
            self.eager, self.reason = True, f"{ENFORCE_EAGER_ENV} is set"
        elif self.device.type != "cuda":
            self.eager, self.reason = True, "on CPU unless enforce_eager is false"
        else:
            self.eager, self.reason = False, "compiled"
        self.compile_seconds = 0.0
        self._compiled = None
        self._plain = None   # where CUDA graphs are on: the forward compiled without them
        self.cuda_graphs = False
        self.plain_fusion_after: str | None = None   # the code-generation failure PLAIN_FUSION followed
        self.failure_traceback: str | None = None   # why compiling failed, whole (for a report)
        if not self.eager:
            compile_cache_dir()
            # Sizes of 1 are not specialized where the shapes alone decide; flex_attention's and
            # the stores' own checks still trace a single token, a decode batch and longer steps
            # apart, which the runner's warm-up covers.
            torch.fx.experimental._config.backed_size_oblivious = True
            # Sizes that happen to be equal at trace time (rows and new tokens, both 1) stay
            # separate symbols, not one guarded equality.
            torch.fx.experimental._config.use_duck_shape = False
            # The Python numbers a forward reads (head counts and sizes, the block size, aux layer
            # numbers, a rotary embedding's attention scaling) are the model's and the cache's
            # constants; what changes from step to step are tensor shapes. Left unspecialised, an int
            # becomes a symbol (on which math.gcd breaks the graph, and a dict keyed by ints misses)
            # and a float a CPU scalar tensor input (for which inductor's CUDA graphs skip the graph).
            torch._dynamo.config.specialize_int = True
            torch._dynamo.config.specialize_float = True
            # Every engine in a process compiles the same forward's code (its own weights and pools
            # guard apart), twice where CUDA graphs fail: dynamo's default of 8 graphs a function
            # is spent by a few engines.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
            # Past the limit dynamo would run the forward uncompiled while this object still says
            # compiled, and the view's flex_attention would then run as its dense reference over the
            # whole pool; raising instead lets warm-up fall back to the eager forward (and a later
            # step fail loudly rather than exhaust memory).
            torch._dynamo.config.fail_on_recompile_limit_hit = True
            # On CUDA, CUDA graphs (inductor's cudagraph trees) per padded batch size of the ladder,
            # for the steps the caller graphs; the others (a prefill chunk, a batch beyond the
            # ladder) run the same forward compiled without graphs (`_plain`): cudagraph trees
            # record a graph for every new shape they meet, and keep its memory.
            self.cuda_graphs = self.device.type == "cuda" and cuda_graphs
            self._compiled = self._compile(self.cuda_graphs)
            self._plain = self._compile(False) if self.cuda_graphs else None

    def _compile(self, cuda_graphs: bool) -> Callable:
        """torch.compile of the forward, with CUDA graphs or without, as one graph (fullgraph): a
        graph break would cost the step a return to Python between the pieces (and a CUDA graph
        for each), and one dynamo cannot resume from makes it give up on the forward's code for
        the whole process, every later engine's included; whole or not at all, a forward that
        breaks fails warm-up and serves eager, saying where. Inductor's graph partitioning
        (splitting a graph around what cannot be captured) is off: its generated code has named
        buffers it never defined for this forward on CUDA; a graph that cannot be captured runs
        its compiled kernels without one instead."""
        options = dict(self.inductor_options)
        if cuda_graphs:
            options.update({"triton.cudagraphs": True, "graph_partition": False})
        if self.plain_fusion_after is not None:
            options.update(plain_fusion_options())
        return torch.compile(self.eager_forward, dynamic=True, fullgraph=True, options=options or None)

    @property
    def attention_kernel(self) -> str:
        """The attention kernel the forward's view should use: flex inside a compiled graph, the
        gathering SDPA eagerly (eager flex_attention is a dense reference over the whole pool)."""
        return "gather" if self.eager else "flex"

    def warm_up(self, run: Callable[[], object], model_path: str) -> None:
        """Run `run` (forwards through this object, of the shapes to trace) once, compiling. A
        failure to generate the kernels compiles again with PLAIN_FUSION; another failure under
        CUDA graphs compiles again without them; a failure left serves eager from then on (`run`
        is then repeated eagerly); each with one warning naming why. An eager forward has nothing
        to trace: it runs nothing at start."""
        if self.eager:
            return
        started = time.perf_counter()
        failure = self._first_run(run)
        if failure is not None and code_generation_failed(failure):   # inductor's kernels, not graphs
            self.plain_fusion_after = failure
            self._compiled = self._compile(self.cuda_graphs)
            self._plain = self._compile(False) if self.cuda_graphs else None
            logger.warning("%s: inductor failed to generate the forward, compiling with its loop-rewriting "
                           "fusions off: %s", model_path, failure)
            failure = self._first_run(run)
        if failure is not None and self.cuda_graphs and not code_generation_failed(failure):
            self.cuda_graphs, self._compiled, self._plain = False, self._compile(False), None
            self.reason = f"CUDA graphs failed ({failure})"
            logger.warning("%s: the forward under CUDA graphs failed, compiling without: %s", model_path, failure)
            failure = self._first_run(run)
        if failure is not None:   # what dynamo or inductor cannot compile serves eager
            self.eager, self._compiled, self._plain = True, None, None
            self.reason = f"compiling failed ({failure})"
            logger.warning("%s: torch.compile of the forward failed, serving eager: %s", model_path, self.reason)
            run()
        self.compile_seconds = time.perf_counter() - started

    def _first_run(self, run: Callable[[], object]) -> str | None:
        """Run `run` through the compiled forward; -> None, or why it failed in one line (the
        first failure's whole traceback is kept in failure_traceback)."""
        try:
            run()
        except Exception as error:
            self.failure_traceback = self.failure_traceback or traceback.format_exc()
            return f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        return None

    def __call__(self, *args, graphed: bool = False):
        """The forward over args (a runner's: input ids and the cache's view); graphed: the step is
        padded to a rung of the ladder, so it may run under CUDA graphs (where they are on), else
        it runs compiled without them."""
        if self.eager:
            return self.eager_forward(*args)
        forward = self._plain if self._plain is not None and not graphed else self._compiled
        return forward(*args)

    def describe(self) -> str:
        """For the start-up line: eager or compiled, and what compiling cost."""
        if self.eager:
            return f"eager forward ({self.reason})"
        if self.cuda_graphs:
            graphs = ", CUDA graphs for batches of " + "/".join(map(str, CUDA_GRAPH_BATCH_SIZES))
        elif self.device.type == "cuda":
            graphs = f", no CUDA graphs: {self.reason if self.graphs_asked else 'not asked for'}"
        else:
            graphs = ""
        if self.plain_fusion_after is not None:
            graphs += f", loop-rewriting fusions off after {self.plain_fusion_after}"
        if self.inductor_options:
            graphs += ", inductor options " + ", ".join(f"{k}={v}" for k, v in sorted(self.inductor_options.items()))
        return (f"compiled forward{graphs} ({self.compile_seconds:.1f} s to compile at start; cache "
                f"{compile_cache_dir()})")
