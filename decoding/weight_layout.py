"""Linear weights stored input-major for the CPU engines.

Why: a decode, draft or verify step multiplies a few rows by every weight matrix, and on the CPU
that product reads each matrix once, so it costs what reading the weights costs. PyTorch keeps an
`nn.Linear` weight as [out, in] and computes x · Wᵀ; for few rows the BLAS it calls (MKL) runs that
transposed case far slower than the same product over the matrix stored [in, out] (x · W), the
LM head most of all. Storing the matrix input-major keeps the parameter's shape and values: the
weight becomes the transpose view of an [in, out] tensor, so every forward (the lean forward,
transformers' own, the compiled one) and every weight swap (`load_state_dict` copies into it)
runs unchanged. Measured per step in docs/performance.md ("Weights stored input-major").

Only plain float32 matrices of `nn.Linear` modules are re-stored (the measured case); quantized
and half-precision weights and tensor subclasses (a DTensor shard) keep their layout, and GPUs
(whose GEMMs take either layout) are not touched. A weight tied to the input embedding is
re-stored too: the embedding's lookup then reads strided rows, a cost only a prefill pays, once
per token.
"""

from __future__ import annotations

import torch


def input_major_linears(model: torch.nn.Module) -> int:
    """Store each plain float32 `nn.Linear` weight of `model` (on the CPU) as the transpose view
    of an [in, out] tensor, in place; shapes and values unchanged. -> how many were re-stored."""
    restored = 0
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        weight = module.weight
        if (type(weight.data) is not torch.Tensor or weight.device.type != "cpu" or weight.dtype != torch.float32
                or weight.dim() != 2 or not weight.is_contiguous()):
            continue   # another kind of tensor, or already re-stored (a tied weight seen twice)
        with torch.no_grad():
            weight.data = weight.data.t().contiguous().t()
        restored += 1
    return restored
