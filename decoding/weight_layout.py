"""Linear weights laid out for the CPU engines: input-major for a single row, and a copy in
oneDNN's packed layout for several.

Why: a decode, draft or verify step multiplies a few rows by every weight matrix, and on the CPU
that product reads each matrix once, so it costs what reading the weights costs. PyTorch keeps an
`nn.Linear` weight as [out, in] and computes x · Wᵀ; for one row the BLAS it calls (MKL) runs that
transposed case far slower than the same product over the matrix stored [in, out] (x · W), the
LM head most of all. Storing the matrix input-major keeps the parameter's shape and values: the
weight becomes the transpose view of an [in, out] tensor, so every forward (the lean forward,
transformers' own, the compiled one) and every weight swap (`load_state_dict` copies into it)
runs unchanged.

For a few rows (a verify's K + 1, a batch's decode rows) MKL's matrix product reads the weights
far slower than its single-row product does, while oneDNN's product over a weight reordered once
into its own blocked layout keeps pace. So each such Linear also holds that reordered copy
(`pack_linears`) and takes it from PACKED_MIN_ROWS rows up (`PackedLinear`); a single row stays
with MKL over the input-major weight. The copy doubles the Linear weights' memory; a weight swap
must reorder it again (`repack_linears`). Measured per step in docs/performance.md ("Weights
stored input-major", "Several rows: oneDNN's packed weights").

Only plain float32 matrices of `nn.Linear` modules are re-stored and packed (the measured case);
quantized and half-precision weights and tensor subclasses (a DTensor shard) keep their layout, and
GPUs (whose GEMMs take either layout) are not touched. A weight tied to the input embedding is
re-stored too: the embedding's lookup then reads strided rows, a cost only a prefill pays, once
per token.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

# From this many rows a product takes the packed copy (fewer: MKL over the input-major weight,
# the faster for one row; two are about even); the copy is reordered for PACK_ROWS_HINT rows.
PACKED_MIN_ROWS = 3
PACK_ROWS_HINT = 8


class PackedCopies:
    """Weight tensor -> its packed copy, by the tensor's identity (a tensor's == is elementwise),
    held while the weight lives. A plain dict keyed by id(): every product of several rows looks its
    weight up, and torch's WeakIdKeyDictionary builds a weak reference for each lookup. Each entry
    keeps a weak reference to its weight, which tells a live weight from a collected one whose id a
    new tensor took, and whose callback drops the entry when the weight goes."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, torch.Tensor]] = {}

    def get(self, weight: torch.Tensor) -> torch.Tensor | None:
        entry = self._entries.get(id(weight))
        return entry[1] if entry is not None and entry[0]() is weight else None

    def __contains__(self, weight: torch.Tensor) -> bool:
        return self.get(weight) is not None

    def __len__(self) -> int:
        return len(self._entries)

    def __setitem__(self, weight: torch.Tensor, packed: torch.Tensor) -> None:
        key, entries = id(weight), self._entries

        def forget(ref: weakref.ref) -> None:
            if entries.get(key, (None,))[0] is ref:   # not an entry of a newer tensor with the same id
                entries.pop(key, None)
        entries[key] = (weakref.ref(weight, forget), packed)

    def pop(self, weight: torch.Tensor) -> None:
        if weight in self:
            del self._entries[id(weight)]


# Each weight's packed copy. Beside the weight, not in its module: a oneDNN tensor has no storage
# to copy, so a model copied with copy.deepcopy (the tests' references, a saved draft version)
# gets none, and its Linears compute as plain ones. Keyed by the tensor a forward passes (a
# Parameter keeps its identity through a weight swap's in-place copy), so one module may hold
# several (an LM head over a token map: its whole weight and its map's rows).
_PACKED = PackedCopies()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x · weightᵀ + bias, over weight's packed copy (`pack_weight`) for PACKED_MIN_ROWS
    float32 rows or more where it has one, outside autograd (the copy carries no gradient to the
    weight: a model trained takes the plain product); traced by torch.compile, the plain product
    too (the compiled graph is inductor's to lay out)."""
    # Asked first: traced, a test of the rows would put a guard on them in the graph.
    if (not torch.compiler.is_compiling() and not torch.is_grad_enabled()
            and x.numel() >= PACKED_MIN_ROWS * x.shape[-1]):
        packed = _PACKED.get(weight)
        if packed is not None and x.dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class PackedLinear(torch.nn.Linear):
    """An nn.Linear (same parameters, same state dict) whose product over several rows reads its
    packed copy (`pack_linears`, `linear`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def _plain_cpu_float32(weight: torch.Tensor) -> bool:
    return (type(weight.data) is torch.Tensor and weight.device.type == "cpu" and weight.dtype == torch.float32
            and weight.dim() == 2)


def input_major_linears(model: torch.nn.Module) -> int:
    """Store each plain float32 `nn.Linear` weight of `model` (on the CPU) as the transpose view
    of an [in, out] tensor, in place; shapes and values unchanged. -> how many were re-stored."""
    restored = 0
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        weight = module.weight
        if not _plain_cpu_float32(weight) or not weight.is_contiguous():
            continue   # another kind of tensor, or already re-stored (a tied weight seen twice)
        with torch.no_grad():
            weight.data = weight.data.t().contiguous().t()
        restored += 1
    return restored


def pack_linears(model: torch.nn.Module) -> int:
    """Give each plain float32 `nn.Linear` of `model` (on the CPU) its packed copy, which its
    product over several rows takes from then on (the module becomes a PackedLinear: same
    parameters and state dict); a PackedLinear's subclass (an LM head over a token map:
    decoding.token_map) gets the copy of its weight and stays what it is. -> how many were packed (none where
    oneDNN is not built in)."""
    if not torch.backends.mkldnn.is_available():
        return 0
    packed = 0
    for module in model.modules():
        if (type(module) is torch.nn.Linear or isinstance(module, PackedLinear)) and _plain_cpu_float32(module.weight):
            if type(module) is torch.nn.Linear:
                module.__class__ = PackedLinear
            pack_weight(module.weight)
            packed += 1
    return packed


def repack_linears(model: torch.nn.Module) -> None:
    """Reorder every PackedLinear's copy in `model` from its weight as it is now: after a weight
    swap, which copies new values into the weights but not into the copies."""
    for module in model.modules():
        if isinstance(module, PackedLinear) and module.weight in _PACKED:
            pack_weight(module.weight)


def pack_weight(weight: torch.Tensor) -> None:
    """Give weight (one a forward passes to `linear`) a packed copy of its values as they are now,
    or none where it is not a plain float32 CPU matrix or oneDNN is not built in."""
    if torch.backends.mkldnn.is_available() and _plain_cpu_float32(weight):
        _PACKED[weight] = _reordered(weight)
    else:
        _PACKED.pop(weight)


def _reordered(weight: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
