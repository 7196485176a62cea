"""Shared test fixtures. Tests run on CPU in float32 with one torch thread (CI has 2 cores)."""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="module")
def no_ray_left_behind():
    """A module that fails half-way (an assertion between start and stop, a timeout) must not leave
    its Ray cluster to the next module, whose own ray.init would then fail: one real failure,
    not a cascade of errors."""
    yield
    import ray

    if ray.is_initialized():
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()


@pytest.fixture(scope="session")
def checkpoint_families(tmp_path_factory):
    """Look-alikes of the Llama-3, Qwen2.5 and Mistral checkpoints (tests/checkpoint_fixtures.py),
    built once per session."""
    from tests.checkpoint_fixtures import build_all

    return build_all(tmp_path_factory.mktemp("checkpoints"))
