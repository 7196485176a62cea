"""Host-to-device copies that do not make the host wait.

A step's small index tensors (block tables, row lengths, input ids, sampling parameters) are built
on the host from Python lists. Copied from ordinary (pageable) memory, CUDA has the host wait for
the copy to finish; copied from pinned memory with non_blocking, the copy is queued on the stream
like a kernel, and the host goes on building the next step. PyTorch's pinned-memory allocator keeps
the buffer until the copy has run, so the host tensor may be dropped at once. On CPU nothing moves.
"""

from __future__ import annotations

import torch


def host_to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """tensor (on the host) on device, queued without a host sync where device is CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def index_on(positions: list[int], device: torch.device | str) -> torch.Tensor:
    """positions (a host list of row or column indices) as a long tensor on device, without a host
    sync: indexing a device tensor with a Python list copies the list from pageable memory."""
    return host_to_device(torch.tensor(positions, dtype=torch.long), device)
