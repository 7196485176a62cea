"""Host-to-device copies of a step's small tensors (decoding/device_copy.py): the values arrive
unchanged and index lists arrive as long tensors. That the copy makes no host wait is a CUDA
property: the GPU check counts host syncs per step (bench/gpu_check.py, docs/gpu.md)."""

from __future__ import annotations

import pytest
import torch

from specserve.decoding.device_copy import host_to_device, index_on

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="no GPU on this machine"))]


@pytest.mark.parametrize("device", DEVICES)
def test_values_arrive_unchanged(device):
    host = torch.tensor([[3, -1, 7], [0, 2, 5]], dtype=torch.int32)
    moved = host_to_device(host, device)
    assert moved.device.type == device and moved.dtype == torch.int32
    assert torch.equal(moved.cpu(), host)


@pytest.mark.parametrize("device", DEVICES)
def test_an_index_list_arrives_as_a_long_tensor_that_indexes_like_the_list(device):
    rows = torch.arange(12.0, device=device).view(6, 2)
    positions = [4, 0, 4, 2]
    index = index_on(positions, device)
    assert index.dtype == torch.long and index.device.type == device
    assert torch.equal(rows.index_select(0, index), rows[positions])
