"""Speculative speculative decoding in the draft engine, in-process (no Ray): the runner's forked
branches share KV safely, a round whose outcome was pre-drafted is answered from the speculation
cache, greedy output equals the target's own, nothing is held after release, and sampled output
over several rounds follows the target's exact joint distribution with hits and misses both
frequent (and the same test rejects pre-drafts that replay their request's draft stream); seeded
sampled output is token for token the same with the cache as with plain rounds.

The equalities asserted here hold on CPU in float32, where the tests run; on a GPU in bf16 greedy
output may differ at near-ties and with what shares a batch (docs/gpu.md)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import torch
from transformers import LlamaForCausalLM

import specserve.decoding.proposers as proposers
import specserve.deployments.draft_worker as draft_worker
from specserve.decoding.batched_runner import BatchedModelRunner
from specserve.decoding.compact_verify import DraftSupport
from specserve.decoding.scheduler import Scheduler
from specserve.decoding.generate import generate
from specserve.decoding.proposers import Proposal, SaguaroSampling
from specserve.decoding.sampling import SamplingParams, draft_seed, logits_to_probs, make_generator
from specserve.decoding.sequence import RequestState
from specserve.decoding.speculation import accept_round
from specserve.deployments.committed_history import HistorySender, RunningDigest
from specserve.deployments.draft_worker import DraftEngine
from specserve.deployments.target_worker import TargetEngine
from tests.test_engines import options, spec
from tests.test_generate import VOCAB_SIZE, null_tv_bound, perturbed_copy, tiny_llama
from tests.test_serving_statistics import chi_square_p_value, total_variation
from tests.eagle3_fixtures import build_eagle3_head
from tests.tiny_pair import make_tiny_pair

PROMPTS = [[5, 17, 42, 8, 3, 33], [60, 2, 2, 9, 14, 27, 50, 11, 7], [12, 40, 21, 40, 21]]
# The joint test's prompt: two full KV blocks and a bit, so every request after the first finds the
# blocks in both engines' prefix caches (sampling must stay exact with cached prefixes too).
SHARED_PROMPT = (PROMPTS[1] + PROMPTS[2]) * 2 + PROMPTS[0]   # 34 tokens, ending as PROMPTS[0]
NUM_DRAFT = 3
DISTANT_NOISE = 0.02
HEAD_LAYERS = [0, 1, 1]   # the tiny target's layers an EAGLE-3 look-alike head reads
# The joint test: 4 output tokens (the prefill's, then speculative rounds of K = 2), top-k 3, so the
# joint has 81 cells; each round's fan-out is drawn (seeded) from these, for hits and misses.
JOINT_TOKENS, JOINT_K, JOINT_TOP_K, NUM_REQUESTS, CONCURRENCY = 4, 2, 3, 2000, 100
FAN_OUTS = [(8, 8, 1), (8, 8, 1), (8, 8, 1), ()]
P_VALUE_FLOOR = 1e-3
BROKEN_SAGUARO_REQUESTS = 400
# The joint test's drafts sample with Saguaro sampling: the likeliest of the 3 tokens scaled by 0.3.
JOINT_LOWERED, JOINT_DOWNWEIGHT = 1, 0.3


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def distant_pair(tmp_path_factory):
    """Untied tiny Llamas (tests.test_generate's), the draft noisier: greedy text that does not just
    repeat, with rejections (misses, recovered tokens) and accepted runs (hits)."""
    root = tmp_path_factory.mktemp("distant")
    target = tiny_llama(seed=0)
    for model, name in ((target, "target"), (perturbed_copy(target, noise_std=DISTANT_NOISE, seed=1), "draft")):
        model.save_pretrained(root / name)
    return root / "target", root / "draft"


def new_engines(pair, max_sequences: int, **overrides) -> tuple[DraftEngine, TargetEngine]:
    target, draft = pair
    batching = options(max_batch_rows=8 * max_sequences, prefill_token_budget=16 * max_sequences, **overrides)
    return (DraftEngine("draft", spec(draft, 8 * max_sequences), str(target), batching),
            TargetEngine(spec(target, max_sequences), batching))


async def decode(draft: DraftEngine, target: TargetEngine, state: RequestState, num_draft, fan_outs,
                 predraft_depths=lambda round_index: 0) -> list[bool]:
    """A request's rounds as the router runs them (engines keep the committed history); the depth
    of each round num_draft (or num_draft(round)), its fan-out fan_outs(round), its pre-drafts'
    depth predraft_depths(round) (0: the round's); a target serving an EAGLE-3 head answers its
    features, carried to the draft engine with the next propose as the router does
    (deployments.request_engines). -> per round after the first, whether it was a hit."""
    digest = RunningDigest()
    to_draft, to_target = HistorySender(digest), HistorySender(digest)
    params, seed = state.params, draft_seed(state.params.seed)
    rows, span = await target.verify(state.request_id, to_target.update(state), None, params, state.next_output_index)
    accept_round(state, Proposal([], None), rows)
    features = span.features
    hits, round_index = [], 0
    while not state.finished:
        depth = num_draft(round_index) if callable(num_draft) else num_draft
        committed = None if features is None else features.before(len(state.history) - 1)
        proposal, _ = await draft.propose(state.request_id, to_draft.update(state), depth, params, seed,
                                          len(state.prompt_ids), fan_outs(round_index), committed,
                                          predraft_depths(round_index))
        if round_index:
            hits.append(proposal.cached)
        rows, span = await target.verify(state.request_id, to_target.update(state), proposal, params,
                                         state.next_output_index)
        features = span.features
        accept_round(state, proposal, rows)
        round_index += 1
    await draft.release(state.request_id)
    await target.release(state.request_id)
    return hits


def test_a_forked_branch_shares_blocks_and_neither_sequence_sees_the_others_tokens(pair):
    target_path, _ = pair
    engine = Scheduler(BatchedModelRunner(str(target_path)))
    fresh = Scheduler(BatchedModelRunner(str(target_path)))
    history = list(range(20, 60))                     # 40 tokens: two full blocks and a partial one
    engine.forward("parent", history, 1)
    used = engine.kv_usage()["kv_blocks_used"]
    engine.blocks.fork("parent", "child")
    assert engine.kv_usage()["kv_blocks_used"] == used   # shared, not copied
    child = history[:33] + [7, 8]
    torch.testing.assert_close(engine.forward("child", child, 2), fresh.forward("c", child, 2))
    parent = history + [9]
    torch.testing.assert_close(engine.forward("parent", parent, 2), fresh.forward("p", parent, 2))
    engine.blocks.adopt("parent", "child")                   # the parent takes over the child's KV
    torch.testing.assert_close(engine.forward("parent", child + [3], 1), fresh.forward("c2", child + [3], 1))
    engine.release("parent")
    assert engine.kv_usage()["kv_blocks_used"] == 0 and engine.blocks.active_sequences() == []


def greedy_rounds_with_predrafts(engines, target_path, fan_out: tuple[int, ...]) -> DraftEngine:
    """Every prompt decoded greedily at once on engines() (-> draft, target), each round
    pre-drafting fan_out's outcomes: the texts are the target's own greedy texts and rounds both
    hit and miss. -> the draft engine, its requests released."""
    reference = Scheduler(BatchedModelRunner(str(target_path)))
    params = SamplingParams(temperature=0, max_tokens=40)

    async def scenario():
        draft, target = engines()
        states = [RequestState(f"g{i}", list(prompt), params, eos_token_id=None, max_context=256)
                  for i, prompt in enumerate(PROMPTS)]
        hits = await asyncio.gather(*[decode(draft, target, state, NUM_DRAFT, lambda _: fan_out) for state in states])
        await draft.loop.between_iterations()
        return states, hits, draft

    states, hits, draft = asyncio.run(scenario())
    for i, state in enumerate(states):
        expected = RequestState(f"r{i}", list(PROMPTS[i]), params, eos_token_id=None, max_context=256)
        list(generate(reference, expected))
        assert state.output_ids == expected.output_ids
    every = [hit for request in hits for hit in request]
    assert 0 < sum(every) < len(every), "both hits and misses must happen"
    assert draft.speculation == {}
    return draft


def test_greedy_rounds_hit_the_speculation_cache_and_equal_the_targets_greedy_output(distant_pair):
    draft = greedy_rounds_with_predrafts(lambda: new_engines(distant_pair, len(PROMPTS)), distant_pair[0],
                                         (1, 1, 0, 1))
    assert draft.scheduler.blocks.active_sequences() == [] and draft.scheduler.kv_usage()["kv_blocks_used"] == 0


@pytest.fixture(scope="module")
def head_pair(distant_pair, tmp_path_factory):
    """The distant pair's target and an EAGLE-3 look-alike head for it (random weights over the
    whole vocabulary: its blocks are often rejected, its pre-drafts sometimes hit)."""
    target_path, _ = distant_pair
    head = build_eagle3_head(target_path, tmp_path_factory.mktemp("head") / "head", "speculators",
                             draft_vocab=VOCAB_SIZE, aux_layers=HEAD_LAYERS)
    return target_path, head


def head_engines(head_pair, max_sequences: int) -> tuple[DraftEngine, TargetEngine]:
    """An EAGLE-3 head's draft engine and its target's engine computing the head's layers."""
    target_path, head = head_pair
    batching = options(max_batch_rows=8 * max_sequences, prefill_token_budget=16 * max_sequences)
    return (DraftEngine("eagle3", {**spec(head, 8 * max_sequences), "target_path": str(target_path)},
                        str(target_path), batching),
            TargetEngine({**spec(target_path, max_sequences), "aux_layers": HEAD_LAYERS}, batching))


def test_greedy_rounds_with_an_eagle3_head_pre_draft_and_equal_the_targets_greedy_output(head_pair):
    """The speculation cache with an EAGLE-3 head: each block's outcomes are pre-drafted from the
    head's own features (Eagle3Proposer.fork), rounds hit and miss, the text is the target's own
    greedy text, and no head state is left once the requests are released."""
    draft = greedy_rounds_with_predrafts(lambda: head_engines(head_pair, len(PROMPTS)), head_pair[0], (2, 1, 0, 1))
    assert draft.proposer.sequences == {}


def test_a_round_deeper_than_the_last_hits_only_where_the_last_pre_drafted_that_deep(distant_pair):
    """A pre-drafted block is used cut to its round's depth, never lengthened: a round drafting
    deeper than the one before it (a depth probe: policies.depth_chooser) finds its block only
    where that round pre-drafted as deep (DepthChooser.predraft_depth). Greedy output stays the
    target's either way."""
    target_path, _ = distant_pair
    reference = Scheduler(BatchedModelRunner(str(target_path)))
    params = SamplingParams(temperature=0, max_tokens=40)

    def depth(round_index: int) -> int:
        return 4 if round_index % 2 else 2

    async def scenario(predraft_depths):
        draft, target = new_engines(distant_pair, len(PROMPTS))
        states = [RequestState(f"d{i}", list(prompt), params, eos_token_id=None, max_context=256)
                  for i, prompt in enumerate(PROMPTS)]
        hits = await asyncio.gather(*[decode(draft, target, state, depth, lambda _: (1, 1, 0, 1), predraft_depths)
                                      for state in states])
        return states, hits

    expected = []
    for i, prompt in enumerate(PROMPTS):
        expected.append(RequestState(f"r{i}", list(prompt), params, eos_token_id=None, max_context=256))
        list(generate(reference, expected[-1]))
    for planned in (False, True):
        states, hits = asyncio.run(scenario((lambda i: depth(i + 1)) if planned else (lambda i: 0)))
        assert [state.output_ids for state in states] == [state.output_ids for state in expected]
        # hits[j] is round j + 1's
        deeper = [hit for request in hits for j, hit in enumerate(request) if depth(j + 1) > depth(j)]
        assert deeper and (sum(deeper) > 0) == planned, (planned, deeper)


def test_a_seeded_request_gives_the_same_tokens_with_the_cache_as_with_plain_rounds(distant_pair):
    """A hit's block is the very block drafting just in time would draw (the pre-draft starts from
    a copy of the request's draft stream, the bonus guess draws nothing, and a hit leaves the
    stream where that draft would): seeded sampled output is token for token the same with
    pre-drafting as without, while rounds hit."""
    params = SamplingParams(temperature=1.0, top_k=8, max_tokens=24)

    async def decode_all(fan_out):
        draft, target = new_engines(distant_pair, len(PROMPTS))
        states = [RequestState(f"q{i}", list(prompt), params.model_copy(update={"seed": 11 + i}), eos_token_id=None,
                               max_context=256) for i, prompt in enumerate(PROMPTS)]
        hits = await asyncio.gather(*[decode(draft, target, state, NUM_DRAFT, lambda _: fan_out) for state in states])
        return [state.output_ids for state in states], sum(sum(request) for request in hits)

    plain, no_hits = asyncio.run(decode_all(()))
    cached, hits = asyncio.run(decode_all((2, 1, 1, 1)))
    assert no_hits == 0 and hits > 0
    assert cached == plain


def test_a_request_released_right_after_its_propose_leaves_no_pre_draft_behind(distant_pair):
    """The pre-drafts' calls are queued by tasks that start after propose returns; a release that
    comes first (the client went away) must leave nothing: those calls are refused, not queued."""
    from tests.test_engines import whole

    async def scenario():
        draft, _ = new_engines(distant_pair, 2)
        params = SamplingParams(temperature=0, max_tokens=8)
        await draft.propose("gone", whole(PROMPTS[0]), NUM_DRAFT, params, None, len(PROMPTS[0]), (1, 1, 0, 1))
        await draft.release("gone")          # before the pre-drafts' tasks ran
        await asyncio.sleep(0.5)
        await draft.loop.between_iterations()
        return draft.scheduler.blocks.active_sequences(), draft.speculation, draft.scheduler.kv_usage()["kv_blocks_used"]

    assert asyncio.run(scenario()) == ([], {}, 0)


def test_a_request_released_while_its_block_is_drafted_starts_no_pre_draft(distant_pair):
    """The release lands while propose waits for the block it drafts now (the client went away
    mid-round): its forget has run when propose resumes, so pre-drafts started then would never be
    dropped, and a fork of a released sequence prefills its whole history as a sequence of its own."""
    from tests.test_engines import whole

    async def scenario():
        draft, _ = new_engines(distant_pair, 2)
        drafted = draft.submit

        async def released_meanwhile(call):
            answer = await drafted(call)
            if call.fork_of is None:
                await draft.release(call.seq_id)
            return answer

        draft.submit = released_meanwhile
        params = SamplingParams(temperature=0, max_tokens=8)
        await draft.propose("gone", whole(PROMPTS[0]), NUM_DRAFT, params, None, len(PROMPTS[0]), (1, 1, 0, 1))
        await asyncio.sleep(0.5)
        await draft.loop.between_iterations()
        return draft.scheduler.blocks.active_sequences(), draft.speculation, draft.verifying

    assert asyncio.run(scenario()) == ([], {}, {})


def exact_joint(target_path, prompt: list[int], params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(t1..tn) for every n-token output in the processed target's support, in float64."""
    model = LlamaForCausalLM.from_pretrained(target_path).eval()
    joint = {(): 1.0}
    for _ in range(JOINT_TOKENS):
        prefixes = list(joint)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1].double()
        probs = logits_to_probs(logits, params).double()
        joint = {prefix + (token,): joint[prefix] * float(probs[i, token])
                 for i, prefix in enumerate(prefixes) for token in torch.nonzero(probs[i]).flatten().tolist()}
    total = sum(joint.values())   # 1 up to the rows' float32 rounding
    return {cell: probability / total for cell, probability in joint.items()}


def saguaro_engines(pair, max_sequences: int) -> tuple[DraftEngine, TargetEngine]:
    """The draft model's engines, its sampled rows lowered by Saguaro sampling as the joint test sets it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(proposers, "SAGUARO_LOWERED", JOINT_LOWERED)   # the registry reads it when it builds
        draft, target = new_engines(pair, max_sequences, saguaro_downweight=JOINT_DOWNWEIGHT)
    assert draft.proposer.saguaro == SaguaroSampling(JOINT_LOWERED, JOINT_DOWNWEIGHT)
    return draft, target


def sample_joint(pair, params: SamplingParams, seeds: range, engines=saguaro_engines
                 ) -> tuple[list[tuple[int, ...]], int, int, int]:
    """Outputs of seeded requests of SHARED_PROMPT decoded with speculation and the speculation
    cache on engines(pair, concurrency); hits, misses, and the prompt tokens the target found in
    its prefix cache."""
    rounds = torch.Generator().manual_seed(7)   # which fan-out each round gets
    choices = torch.randint(len(FAN_OUTS), (len(seeds), JOINT_TOKENS), generator=rounds).tolist()

    async def scenario():
        draft, target = engines(pair, CONCURRENCY)
        outputs, hits = [], []
        for start in range(0, len(seeds), CONCURRENCY):
            states = [RequestState(f"s{seed}", list(SHARED_PROMPT), params.model_copy(update={"seed": seed}),
                                   eos_token_id=None, max_context=256) for seed in seeds[start:start + CONCURRENCY]]
            picks = choices[start:start + CONCURRENCY]
            hits += await asyncio.gather(*[
                decode(draft, target, state, JOINT_K, lambda r, pick=pick: FAN_OUTS[pick[r]])
                for state, pick in zip(states, picks)])
            outputs += [tuple(state.output_ids) for state in states]
        return outputs, hits, target.scheduler.blocks.prefix_cache_hits

    outputs, hits, prefix_hits = asyncio.run(scenario())
    every = [hit for request in hits for hit in request]
    return outputs, sum(every), len(every) - sum(every), prefix_hits


def fit(outputs: list[tuple[int, ...]], joint: dict) -> tuple[float, float]:
    """(chi-square p-value with cells expected < 5 pooled, total variation) of outputs vs joint."""
    observed = Counter(outputs)
    assert set(observed) <= set(joint), f"{set(observed) - set(joint)} have probability 0 under the target"
    return chi_square_p_value(observed, joint), total_variation(observed, joint)


@pytest.fixture(scope="module")
def joint_case(distant_pair):
    params = SamplingParams(temperature=1.0, top_k=JOINT_TOP_K, max_tokens=JOINT_TOKENS)
    joint = exact_joint(distant_pair[0], SHARED_PROMPT, params)
    return params, joint, null_tv_bound(torch.tensor(list(joint.values())), NUM_REQUESTS)


def test_sampled_rounds_with_hits_and_misses_follow_the_targets_exact_joint(distant_pair, joint_case):
    """2,000 seeded requests of 4 tokens (3 of them from speculative rounds, K = 2), drafted with
    Saguaro sampling, each round's fan-out drawn from FAN_OUTS so that some rounds hit the
    speculation cache and some miss, the
    prompt's two full blocks found in the prefix caches by all but the first batch: the joint of
    the 4 tokens (81 cells) must pass chi-square at 1e-3 and stay under exact sampling's 99.9% TV
    quantile for this joint and sample count."""
    params, joint, tv_bound = joint_case
    outputs, hits, misses, prefix_hits = sample_joint(distant_pair, params, range(NUM_REQUESTS))
    assert hits > 0.15 * (hits + misses) and misses > 0.15 * (hits + misses), (hits, misses)
    assert prefix_hits >= (NUM_REQUESTS - CONCURRENCY) * 32   # the prompt's two full blocks, cached
    p_value, tv = fit(outputs, joint)
    assert p_value > P_VALUE_FLOOR and tv < tv_bound, (p_value, tv, tv_bound)


@pytest.mark.slow   # in make reliability: 2,000 requests through the head's engines take a minute and more
def test_sampled_rounds_with_an_eagle3_heads_pre_drafts_follow_the_targets_exact_joint(head_pair, joint_case):
    """The same joint test with an EAGLE-3 head drafting: its pre-drafts are drawn from the head's
    own features (Eagle3Proposer.fork), where drafting then reads the target's, so a hit's block
    is not the one drafting then would draw; each is verified against the q it was drawn from,
    and the joint must still be the target's."""
    params, joint, tv_bound = joint_case
    outputs, hits, misses, _ = sample_joint(head_pair, params, range(NUM_REQUESTS), head_engines)
    assert hits > 0.05 * (hits + misses) and misses > 0.15 * (hits + misses), (hits, misses)
    p_value, tv = fit(outputs, joint)
    assert p_value > P_VALUE_FLOOR and tv < tv_bound, (p_value, tv, tv_bound)


@pytest.mark.slow   # in make reliability, to keep make test short; make test keeps the cheaper check below
def test_the_joint_test_rejects_pre_drafts_that_replay_the_requests_draft_stream(distant_pair, joint_case,
                                                                                 monkeypatch):
    """The same test with a broken cache: every pre-draft's stream restarted from the request's
    draft seed (so a block reuses the uniforms of blocks the verification already saw) must be
    rejected. It needs all NUM_REQUESTS requests, so it runs in make reliability; make test keeps
    the broken-Saguaro check below, which the joint test rejects on a fifth of them."""
    params, joint, _ = joint_case
    monkeypatch.setattr(draft_worker, "branch_stream_state",
                        lambda stream: make_generator(stream.initial_seed()).get_state())
    outputs, hits, _, _ = sample_joint(distant_pair, params, range(NUM_REQUESTS))
    assert hits > 0
    p_value, _ = fit(outputs, joint)
    assert p_value < P_VALUE_FLOOR, p_value


def test_the_joint_test_rejects_drafts_verified_against_the_row_they_were_not_drawn_from(distant_pair, joint_case,
                                                                                         monkeypatch):
    """The same test with Saguaro sampling broken: the draft draws from its lowered row but ships
    its own row as the q to verify against. Must be rejected; it is, by orders of magnitude, on a
    fifth of the requests (BROKEN_SAGUARO_REQUESTS), where the subtler broken cache above needs
    them all (docs/testing.md)."""
    params, joint, _ = joint_case
    lower = proposers.saguaro_support
    monkeypatch.setattr(proposers, "saguaro_support", lambda support, num_lowered, downweight: support)
    draw = proposers.sample_rows
    monkeypatch.setattr(proposers, "sample_rows", lambda probs, generators: draw(
        lower(DraftSupport(torch.arange(probs.shape[-1]).expand_as(probs), probs), JOINT_LOWERED,
              JOINT_DOWNWEIGHT).probs, generators))
    outputs, hits, _, _ = sample_joint(distant_pair, params, range(BROKEN_SAGUARO_REQUESTS))
    assert hits > 0
    p_value, _ = fit(outputs, joint)
    assert p_value < P_VALUE_FLOOR, p_value
