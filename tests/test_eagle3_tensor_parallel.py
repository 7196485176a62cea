"""An EAGLE-3 head drafting for a tensor-parallel target, served: the look-alike target split
over two ranks (tensor_parallel_size 2, joined by gloo), its rank 0 returning the aux layers'
features with each verdict (`MirroredRunner.run_with_features`), and the head drafting from them
on its own draft engine. Greedy output over HTTP equals the whole target's own greedy output, the
head drafting (docs/eagle3.md). A Serve start of its own, in `make reliability`. The equality
holds on CPU in float32, where the tests run (docs/gpu.md)."""

from __future__ import annotations

import pytest

from tests.eagle3_fixtures import llama3_with_heads
from tests.test_eagle3_serving import assert_greedy_over_http_equals_the_targets_own, serve_args, serving

pytestmark = [pytest.mark.ray, pytest.mark.slow]   # in `make reliability`: docs/testing.md


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return llama3_with_heads(tmp_path_factory.mktemp("eagle3-split"))


@pytest.fixture(scope="module")
def served(family):
    """(url, config): the target over two tensor-parallel ranks, the speculators head drafting."""
    family_, heads = family
    yield from serving(serve_args(family_.target, heads["speculators"], tensor_parallel_size=2))


def test_greedy_over_http_with_a_head_over_a_split_target_equals_the_targets_own(family, served):
    url, config = served
    assert config.target_workers.tensor_parallel_size == 2 and config.speculation.proposer == "eagle3"
    assert_greedy_over_http_equals_the_targets_own(family[0], url, config.model_name)
