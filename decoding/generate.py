"""In-process reference generator (target-only and speculative).

The oracle the distributed path is tested against, and the in-process row of the benchmarks.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from specserve.decoding.target_features import features_start
from specserve.decoding.grammar import GrammarDeadEndError, GrammarMatcher, GrammarMatchers
from specserve.decoding.block_manager import ForwardCall
from specserve.decoding.proposers import ProposeCall, Proposer, empty_proposal, reads_target_features
from specserve.decoding.sequence import RequestState
from specserve.decoding.speculation import (RowsCall, accept_round, answer_verifies, target_rows,
                                            verify_answer)


def generate(target: Any, state: RequestState, proposer: Proposer | None = None,
             num_draft_tokens: int = 4, verification: str = "block",
             grammars: GrammarMatchers | None = None) -> Iterator[list[int]]:
    """Decode state to completion, yielding the (non-empty) tokens committed at each target pass.

    The first pass is the prefill and gives the first token; every later pass verifies up to
    num_draft_tokens tokens from proposer (capped by state.draft_budget). proposer None or
    num_draft_tokens 0 is target-only decoding; verification ("block" or "token") as in accept_round.
    grammars: the target's matchers, needed for a structured output (state.params.structured); the
    proposer keeps its own (DraftModelProposer's grammars), as the draft engine does.
    A proposer that reads the target's features (an EAGLE-3 head) gets each target forward's
    (the target engine built with the head's aux_layers).
    The sequence is released from the target runner and the proposer when decoding ends or the
    iterator is closed."""
    speculate = proposer is not None and num_draft_tokens > 0
    with_features = speculate and reads_target_features(proposer)
    params = state.params
    state.engine_streams_on(target.device)
    try:
        prefilled = False
        while not state.finished:
            history = state.history
            num_tokens = state.draft_budget(num_draft_tokens) if speculate and prefilled else 0
            proposal = (proposer.propose(state.request_id, history, num_tokens, params, state.draft_generator,
                                         len(state.prompt_ids))
                        if num_tokens > 0 else empty_proposal())
            num_drafted = len(proposal.token_ids)
            logits = _target_forward(target, [ForwardCall(state.request_id, history + proposal.token_ids,
                                                          num_drafted + 1)], proposer if with_features else None,
                                     [features_start(history, prefilled)])[0]
            grammar = _target_grammar(state, grammars)
            rows = target_rows(logits, params, state.eos_token_id, state.next_output_index,
                               history + proposal.token_ids, grammar)
            answer = verify_answer(rows, proposal, state.verify_generator, verification)
            committed = accept_round(state, proposal, answer, verification)
            prefilled = True
            if committed:
                yield committed
    finally:
        target.release(state.request_id)
        if grammars is not None:
            grammars.release(state.request_id)
        if proposer is not None:
            proposer.release(state.request_id)


def _target_forward(target: Any, calls: list[ForwardCall], feature_reader: Any, starts: list[int]) -> list:
    """The target's logits for calls; with a feature reader (an EAGLE-3 proposer), from a forward
    that also returns call i's features from position starts[i] on, each handed to it."""
    if feature_reader is None:
        return target.forward_batch(calls)
    logits, features = target.forward_batch_with_features(calls, starts)
    for call, computed in zip(calls, features):
        feature_reader.observe(call.seq_id, computed)
    return logits


def _target_grammar(state: RequestState, grammars: GrammarMatchers | None) -> GrammarMatcher | None:
    """The target's matcher for a structured output, holding the committed output."""
    spec = state.params.structured
    if spec is None:
        return None
    if grammars is None:
        raise ValueError("a structured output needs the target's grammar matchers")
    matcher = grammars.synced(state.request_id, spec, state.output_ids)
    if matcher is None:
        raise GrammarDeadEndError(f"{spec.param}: the output so far does not follow the grammar", spec.param)
    return matcher


def generate_batch(target: Any, states: Sequence[RequestState], proposer: Proposer | None = None,
                   num_draft_tokens: int = 4, verification: str = "block",
                   grammars: GrammarMatchers | None = None) -> None:
    """`generate` for many requests at once, to completion: each round is one `propose_batch` and
    one target `forward_batch` over every unfinished request (how the engines batch), so
    statistical tests and benchmarks get thousands of requests through the real round path
    quickly. A request whose grammar allows nothing (GrammarDeadEndError) finishes with
    finish_reason "error" and the others go on, as on the engines. Sequences are released after."""
    speculate = proposer is not None and num_draft_tokens > 0
    feature_reader = proposer if speculate and reads_target_features(proposer) else None
    prefilled: set[str] = set()
    for state in states:
        state.engine_streams_on(target.device)
    try:
        while running := [state for state in states if not state.finished]:
            calls = [ProposeCall(s.request_id, s.history, s.draft_budget(num_draft_tokens)
                                 if speculate and s.request_id in prefilled else 0, s.params, s.draft_generator,
                                 len(s.prompt_ids)) for s in running]
            proposals = proposer.propose_batch(calls) if speculate else [empty_proposal() for _ in running]
            logits = _target_forward(target, [ForwardCall(s.request_id, s.history + p.token_ids, len(p.token_ids) + 1)
                                              for s, p in zip(running, proposals)], feature_reader,
                                     [features_start(s.history, s.request_id in prefilled) for s in running])
            # As the target engine: every request's rows processed in one batched pass, answered together.
            row_calls = []
            for state, proposal, rows in zip(running, proposals, logits):
                try:
                    row_calls.append(RowsCall(rows.shape[0], state.params, state.next_output_index,
                                              state.history + proposal.token_ids, _target_grammar(state, grammars),
                                              state.eos_token_id))
                except GrammarDeadEndError as exc:
                    row_calls.append(exc)
            answers = answer_verifies(logits, row_calls, proposals, lambda i: running[i].verify_generator,
                                      [verification] * len(running))
            for state, proposal, answer in zip(running, proposals, answers):
                if isinstance(answer, GrammarDeadEndError):  # the others go on, as on the engines
                    state.finish_reason = "error"
                    continue
                accept_round(state, proposal, answer, verification)
                prefilled.add(state.request_id)
    finally:
        for state in states:
            target.release(state.request_id)
            if grammars is not None:
                grammars.release(state.request_id)
            if proposer is not None:
                proposer.release(state.request_id)
