"""Shared test fixtures. Tests run on CPU in float32 with one torch thread (CI has 2 cores)."""

import torch

torch.set_num_threads(1)
