"""An EAGLE-3 head served: `specserve serve --target T --draft HEAD_DIR` detects the head, the
target engine returns its aux layers' features with each verdict, the router carries the
committed ones to the draft engine with the next propose, and greedy output over HTTP (the
official openai client) equals the target's own greedy output (docs/eagle3.md#serving).

One Serve start per checkpoint format (a speculators head, which names its layers and
normalises before the residual; the EAGLE authors', which takes the default layers), in `make
reliability`; on every `make test` the head drafts in process (tests/test_eagle3.py), and so does
the recovery of a draft engine lacking a request's features (UnknownFeatures, below). Both
formats are detected and refused or accepted by the same start-up checks, which run before Ray
starts. The greedy equality holds on CPU in float32,
where the tests run (docs/gpu.md)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from specserve.cluster.builder import served_model_specs
from specserve.cluster.cli import config_from_args, draft_line
from specserve.cluster.local import check_model_paths, start_local
from specserve.decoding.eagle3_checkpoint import Eagle3CheckpointError
from tests.eagle3_fixtures import SPECULATORS_LAYERS, build_eagle3_head, llama3_with_heads
from tests.local_server import free_port, stop_test_cluster

pytestmark = pytest.mark.ray

openai = pytest.importorskip("openai")

PROMPTS = ["def add(a, b):", "import os\nprint(", "the cat sat on"]
# Asked twice: the second time the target's prefix cache holds its first blocks, whose features
# the head still needs.
SHARED_PREFIX_PROMPT = "The quick brown fox jumps over the lazy dog, " * 4 + "and then"
MAX_TOKENS = 24


def serve_args(target, draft, tensor_parallel_size: int | None = None) -> argparse.Namespace:
    """What `specserve serve --target T --draft D [--tensor-parallel-size N]` parses to (the flags
    config_from_args reads)."""
    return argparse.Namespace(config=None, target=str(target), draft=str(draft), tokenizer=None,
                              max_model_len=None, dtype=None, tensor_parallel_size=tensor_parallel_size,
                              enforce_eager=False)


def serving(args: argparse.Namespace):
    """Serve what args say on a free port: yields (url, config), then stops the cluster."""
    config = config_from_args(args)
    config = config.model_copy(update={"http": config.http.model_copy(update={"port": free_port()})})
    url = start_local(config)
    try:
        yield url, config
    finally:
        stop_test_cluster()


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """(the Llama-3 look-alike family, {format: head folder})."""
    return llama3_with_heads(tmp_path_factory.mktemp("eagle3-serving"))


@pytest.fixture(scope="module", params=["speculators", "eagle"])
def served(family, request):
    """(url, config) of the look-alike target served with its head of each format in turn."""
    family_, heads = family
    yield from serving(serve_args(family_.target, heads[request.param]))


@pytest.mark.parametrize("form", ["eagle", "speculators"])
def test_a_head_folder_is_served_as_a_head_with_the_target_computing_its_layers(family, form):
    family_, heads = family
    config = config_from_args(serve_args(family_.target, heads[form]))
    assert config.speculation.proposer == "eagle3"
    assert "EAGLE-3 head" in draft_line(config) and str(family_.target) in draft_line(config)
    target, draft = served_model_specs(config)
    # the speculators head names its layers; the EAGLE authors' takes the default for two layers
    assert target["aux_layers"] == (SPECULATORS_LAYERS if form == "speculators" else [1, 1, 0])
    assert draft["target_path"] == str(family_.target)
    # a draft model's folder stays a draft model
    assert config_from_args(serve_args(family_.target, family_.draft)).speculation.proposer == "draft"


def test_the_start_up_check_reads_no_weight_of_the_target(family):
    """The head is checked against the target's config and embedding shape on the meta device:
    nothing of the target's weights is read (gigabytes for a large target), and it names the same
    layers as the head loaded against the real embeddings."""
    from specserve.cluster.builder import checked_head
    from specserve.decoding.eagle3_checkpoint import load_eagle3_head, target_embeddings

    family_, heads = family
    checked = checked_head(config_from_args(serve_args(family_.target, heads["speculators"])))
    embeddings = target_embeddings(family_.target, torch.float32, "cpu")
    assert all(parameter.is_meta for parameter in checked.head.parameters())
    assert checked.head.embed.weight.shape == embeddings.embed_tokens.weight.shape
    loaded = load_eagle3_head(heads["speculators"], embeddings)
    assert checked.aux_layers == loaded.aux_layers == tuple(SPECULATORS_LAYERS)


@pytest.mark.parametrize("edit, why", [
    ({"target_hidden_size": 128}, "hidden size 128, the target's hidden size is 64"),
    ({"draft_vocab_size": 300}, "lm_head is (256, 64)"),
])
def test_a_malformed_head_is_refused_before_anything_starts_naming_why(family, tmp_path, edit, why):
    family_, heads = family
    folder = build_eagle3_head(family_.target, tmp_path / "bad", "speculators", aux_layers=SPECULATORS_LAYERS)
    config_path = folder / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **edit}))
    config = config_from_args(serve_args(family_.target, folder))
    with pytest.raises(Eagle3CheckpointError, match=why.replace("(", r"\(").replace(")", r"\)")):
        check_model_paths(config)


def test_a_head_without_its_map_is_refused_naming_why(family, tmp_path):
    family_, _ = family
    folder = build_eagle3_head(family_.target, tmp_path / "no-map", "eagle")
    weights = torch.load(folder / "pytorch_model.bin", weights_only=True)
    del weights["d2t"]
    torch.save(weights, folder / "pytorch_model.bin")
    with pytest.raises(Eagle3CheckpointError, match="no d2t"):
        check_model_paths(config_from_args(serve_args(family_.target, folder)))


def target_greedy(family_, prompt_ids: list[int]) -> list[int]:
    """The target's own greedy output ids, in-process and target-only (stopping on the served EOS set)."""
    from specserve.decoding.batched_runner import BatchedModelRunner
    from specserve.decoding.generate import generate
    from specserve.decoding.sampling import SamplingParams
    from specserve.decoding.scheduler import Scheduler
    from specserve.decoding.sequence import RequestState

    engine = Scheduler(BatchedModelRunner(str(family_.target)))
    state = RequestState(request_id="ref", prompt_ids=prompt_ids,
                         params=SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                         eos_token_id=set(family_.eos_ids), max_context=engine.max_context)
    for _ in generate(engine, state):
        pass
    return state.output_ids


def assert_greedy_over_http_equals_the_targets_own(family_, url: str, model: str) -> None:
    """Greedy completions of PROMPTS over HTTP (the official openai client) equal the target's own
    greedy output, the head drafting: the target's features reached it each round (without them
    it answers UnknownFeatures and every round goes target-only, drafting nothing). A prompt asked
    a second time is served from the target's prefix cache and drafts from its first round: the
    features of the positions the cache held came from the cache."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(family_.target))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    drafted = 0
    for text in PROMPTS + [SHARED_PREFIX_PROMPT, SHARED_PREFIX_PROMPT]:
        prompt = tokenizer.encode(text)   # token ids, BOS included: the same prompt both ways
        response = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
        expected = target_greedy(family_, prompt)
        assert response.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True), text
        speculation = response.model_extra["speculation"]
        assert speculation["draft_kind"] == "EAGLE-3 head" and speculation["draft_failures"] == 0
        drafted += speculation["num_drafted"]
    assert response.usage.prompt_tokens_details.cached_tokens >= 16   # the repeat: at least a block
    assert speculation["num_drafted"] > 0
    assert drafted > 0


@pytest.mark.slow   # in make reliability, to keep make test short: docs/testing.md
def test_greedy_over_http_with_a_head_equals_the_targets_own(family, served):
    url, config = served
    assert_greedy_over_http_equals_the_targets_own(family[0], url, config.model_name)


@pytest.mark.slow   # in make reliability, to keep make test short: docs/testing.md
def test_sampled_text_over_http_with_a_head_follows_the_targets_distribution(family, served):
    """tests/test_serving_statistics.py's test with a head for the draft: seeded three-token
    completions (the second token from the first speculative round, which the head drafts from
    the prefill's features) follow the target's exact text distribution, the requests drafted, and
    the same samples reject the target at half the temperature. A random look-alike's top 3 is
    near uniform, so the samples are twice test_serving_statistics'. The look-alike head drafts far
    from its target, so a verifier that accepts every draft token fails this test (docs/testing.md)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from tests.test_serving_statistics import NUM_REQUESTS, assert_follows_the_target

    family_, _ = family
    url, config = served
    # float32, as the server runs it on CPU (the checkpoint says bfloat16, as published ones do)
    target = (LlamaForCausalLM.from_pretrained(str(family_.target), dtype=torch.float32).eval(),
              AutoTokenizer.from_pretrained(str(family_.target)))
    assert_follows_the_target(url, config.model_name, target, {"temperature": 1.5, "top_k": 3}, range(2 * NUM_REQUESTS))


def test_a_draft_engine_lacking_a_requests_features_says_so_and_drafts_once_the_target_recomputes_them(family):
    """A replacement draft engine (in-process, no Ray): it answers UnknownFeatures naming position
    0; the target asked for the features from there returns them from 0, read from its cache
    (its forward computes only the new token); with them the head drafts."""
    import asyncio

    from specserve.common.messages import UnknownFeatures
    from specserve.decoding.proposers import Proposal
    from specserve.decoding.sampling import SamplingParams
    from specserve.decoding.sequence import RequestState
    from specserve.decoding.speculation import accept_round
    from specserve.deployments.committed_history import HistorySender, RunningDigest
    from specserve.deployments.draft_worker import DraftEngine
    from specserve.deployments.target_worker import TargetEngine
    from tests.test_engines import options, spec

    family_, heads = family
    greedy = SamplingParams(temperature=0, max_tokens=8)
    prompt = [5, 17, 42, 8, 3, 33]

    async def scenario():
        target = TargetEngine({**spec(family_.target, 2), "aux_layers": SPECULATORS_LAYERS}, options())
        draft = DraftEngine("eagle3", {**spec(heads["speculators"], 2), "target_path": str(family_.target)},
                            str(family_.target), options())
        state = RequestState(request_id="r", prompt_ids=prompt, params=greedy, eos_token_id=None, max_context=256)
        digest = RunningDigest()
        to_draft, to_target = HistorySender(digest), HistorySender(digest)
        rows, _ = await target.verify("r", to_target.update(state), None, greedy, state.next_output_index)
        accept_round(state, Proposal([], None), rows)
        answer = await draft.propose("r", to_draft.update(state), 3, greedy, None, len(prompt))
        assert answer == UnknownFeatures("r", 0)
        rows, span = await target.verify("r", to_target.update(state), None, greedy, state.next_output_index,
                                         features_from=0)
        accept_round(state, Proposal([], None), rows)
        assert target.scheduler.last_num_new_tokens == 1
        assert span.features.start == 0 and span.features.end == len(state.history) - 1
        proposal, _ = await draft.propose("r", to_draft.update(state), 3, greedy, None, len(prompt), (),
                                          span.features.before(len(state.history) - 1))
        assert len(proposal.token_ids) == 3
        await draft.release("r")
        await target.release("r")

    asyncio.run(scenario())


def test_a_head_serving_targets_round_of_several_steps_answers_every_steps_features(family):
    """A target-only round of four steps on a target serving a head answers what four one-step
    rounds answer, and the features of every position they computed, merged (the head needs
    them all to draft again when the request speculates later)."""
    import asyncio

    from specserve.common.messages import DecodedSteps
    from specserve.decoding.target_features import merged_features
    from specserve.decoding.proposers import Proposal
    from specserve.decoding.sampling import SamplingParams
    from specserve.decoding.sequence import RequestState
    from specserve.decoding.speculation import accept_round
    from specserve.deployments.committed_history import HistorySender, RunningDigest
    from specserve.deployments.target_worker import TargetEngine
    from tests.test_engines import options, spec

    family_, _ = family
    greedy = SamplingParams(temperature=0, max_tokens=16)
    prompt = [5, 17, 42, 8, 3, 33]

    async def scenario(steps: int):
        target = TargetEngine({**spec(family_.target, 2), "aux_layers": SPECULATORS_LAYERS}, options())
        state = RequestState(request_id="r", prompt_ids=prompt, params=greedy, eos_token_id=None, max_context=256)
        to_target, features = HistorySender(RunningDigest()), None
        rows, span = await target.verify("r", to_target.update(state), None, greedy, state.next_output_index)
        accept_round(state, Proposal([], None), rows)
        features = span.features
        for _ in range(4 // steps):
            rows, span = await target.verify("r", to_target.update(state), None, greedy, state.next_output_index,
                                             None, None, "block", None, steps)
            if steps > 1:
                assert isinstance(rows, DecodedSteps) and len(rows.answers) == steps
            for answer in rows.answers if steps > 1 else (rows,):
                accept_round(state, Proposal([], None), answer)
            features = merged_features(features, span.features)
        assert target.decoding == {}
        return state.output_ids, features

    (plain, plain_features), (stepped, stepped_features) = (asyncio.run(scenario(steps)) for steps in (1, 4))
    assert stepped == plain and len(plain) == 5
    assert (stepped_features.start, stepped_features.end) == (plain_features.start, plain_features.end) == (0, 10)
    torch.testing.assert_close(stepped_features.hidden, plain_features.hidden, atol=1e-5, rtol=0)


def test_a_heads_first_round_drafts_from_the_prefills_features_when_the_draft_lookup_answers_late(family):
    """The target prefills before Serve names the draft engine (deployments.round_loop): the
    features its prefill answered are kept for the head all the same, so the first round drafts
    (without them the head would answer UnknownFeatures and the round go target-only). In process,
    over channels, the draft pool's lookup held until the first token is out."""
    import asyncio

    from specserve.common.channel import ChannelPool
    from specserve.common.config import LimitsSpec, SpeculationSpec
    from specserve.decoding.sampling import SamplingParams
    from specserve.decoding.sequence import RequestState
    from specserve.deployments.draft_worker import DraftEngine
    from specserve.deployments.request_engines import RequestEngines
    from specserve.deployments.round_loop import RoundLoop
    from specserve.deployments.target_worker import TargetEngine
    from tests.test_engines import options, spec
    from tests.test_round_history import HeldWorkers, InProcessWorkers, ListeningEngine, recording_observer

    family_, heads = family
    speculation = SpeculationSpec(num_draft_tokens=3, adaptive=False)

    async def scenario():
        target = ListeningEngine(TargetEngine({**spec(family_.target, 2), "aux_layers": SPECULATORS_LAYERS}, options()))
        draft = ListeningEngine(DraftEngine("eagle3", {**spec(heads["speculators"], 2),
                                                       "target_path": str(family_.target)},
                                            str(family_.target), options()))
        held = HeldWorkers(await draft.listen())
        engines = RequestEngines(InProcessWorkers(await target.listen()), held, LimitsSpec(), ChannelPool())
        state = RequestState("r", [5, 17, 42, 8, 3, 33], SamplingParams(temperature=0, max_tokens=12), None, 256,
                             detokenize=lambda ids: " ".join(map(str, ids)))
        observer, records = recording_observer(speculation)
        chunks = []
        loop = RoundLoop(state, engines, observer, chunks.append, lambda state: state.draft_budget(3), lambda: 1,
                         speculation)
        running = asyncio.ensure_future(loop.run(0.0, float("inf")))
        for _ in range(1000):
            if chunks or running.done():
                break
            await asyncio.sleep(0.01)
        first_before_lookup = bool(chunks)
        held.answer.set()
        await running
        return first_before_lookup, records

    first_before_lookup, records = asyncio.run(scenario())
    assert first_before_lookup and records[0].num_drafted > 0
