"""Online draft learning across nodes (docs/online-learning.md) on a real multi-node Ray cluster started on this
machine with `ray start` (tests/test_multinode.py's machinery): the trainer runs on the head (the
only node offering `trainer_node`), the draft engine on a node of its own. With no shared
versions_dir, a trained version reaches the draft engine through Ray's object store: the engine
says it read its weights there, responses carry the new draft_version and greedy texts are
unchanged. Slow (three Ray nodes on two cores, then a training pass): `make reliability`.
tests/test_draft_learning.py proves in process that an engine loads a version whose folder is gone."""

from __future__ import annotations

import openai
import pytest
import ray

from specserve.deployments.draft_worker import OBJECT_STORE
from specserve.common.naming import ENGINE_NAMESPACE, parse_engine_actor_name
from tests.test_draft_learning_served import PROMPTS, complete, traffic, wait_for_a_trained_version
from tests.test_multinode import MODEL, multinode_app

pytestmark = [pytest.mark.ray, pytest.mark.slow]
TRAIN_TIMEOUT_S = 240.0


@pytest.fixture(scope="module")
def learning_cluster(tmp_path_factory):
    training = {"enabled": True, "sample_every": 1, "min_new_positions": 300, "lr": 1e-3, "epochs": 3,
                "canary_margin": 0.002, "num_cpus": 0.5, "resources": {"trainer_node": 1}}
    yield from multinode_app(tmp_path_factory, {"draft_node": 1, "target_node": 1},
                             head_resources={"trainer_node": 1}, draft_training=training)


def draft_engine_versions() -> list[dict]:
    """What each draft engine says it serves (DraftEngine.version)."""
    found = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        parsed = parse_engine_actor_name(entry["name"]) if entry["namespace"] == ENGINE_NAMESPACE else None
        if parsed is not None and parsed[0] == "draft":
            found.append(ray.get(ray.get_actor(entry["name"], namespace=ENGINE_NAMESPACE).version.remote(),
                                 timeout=10))
    return found


def test_a_version_trained_on_the_head_reaches_the_draft_node_through_the_object_store(learning_cluster):
    url, _ = learning_cluster
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    before = traffic(client, MODEL)
    status = wait_for_a_trained_version(TRAIN_TIMEOUT_S, lambda: traffic(client, MODEL))
    assert status and status["draft_version"] >= 1 and set(status["engines"].values()) == {status["draft_version"]}, \
        {key: (status or {}).get(key) for key in ("passes", "last_pass", "captured_total", "engines", "failed_loads",
                                                   "training_now")}
    after = [complete(client, prompt, 0.0, model=MODEL) for prompt in PROMPTS]
    # A response's draft_version names the weights of its last verified block, so one that verified
    # none (it served target-only: no draft engine within limits, or a depth of 0) names no version.
    # Traffic goes on being captured, so a later version may take over meanwhile: at least this one.
    stats = [r.model_extra["speculation"] for r in after]
    drafted = [each for each in stats if each["num_drafted"] > 0]
    assert drafted and all(each["draft_version"] >= status["draft_version"] for each in drafted), stats
    assert [r.choices[0].text for r in after] == [r.choices[0].text for r in before]
    # A loaded version takes over at the engine's next forward: ask after the requests above.
    engines = draft_engine_versions()
    assert len(engines) == 1 and engines[0]["draft_version"] >= status["draft_version"], engines
    assert engines[0]["draft_source"] == OBJECT_STORE
