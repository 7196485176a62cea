"""In-process reference generator (target-only and speculative).

The oracle the distributed path is tested against, and the in-process row of the benchmarks.
"""

from __future__ import annotations

from collections.abc import Iterator

from decoding.grammar import GrammarMatchers
from decoding.model_runner import ModelRunner
from decoding.proposers import Proposer, empty_proposal
from decoding.sequence import RequestState
from decoding.speculation import accept_round, target_rows


def generate(target: ModelRunner, state: RequestState, proposer: Proposer | None = None,
             num_draft_tokens: int = 4, verification: str = "block",
             grammars: GrammarMatchers | None = None) -> Iterator[list[int]]:
    """Decode state to completion, yielding the (non-empty) tokens committed at each target pass.

    The first pass is the prefill and gives the first token; every later pass verifies up to
    num_draft_tokens tokens from proposer (capped by state.draft_budget). proposer None or
    num_draft_tokens 0 is target-only decoding; verification ("block" or "token") as in accept_round.
    grammars: the target's matchers, needed for a structured output (state.params.structured); the
    proposer keeps its own (DraftModelProposer's grammars), as the draft engine does.
    The sequence is released from the target runner and the proposer when decoding ends or the
    iterator is closed."""
    speculate = proposer is not None and num_draft_tokens > 0
    params = state.params
    try:
        prefilled = False
        while not state.finished:
            history = state.history
            num_tokens = state.draft_budget(num_draft_tokens) if speculate and prefilled else 0
            proposal = (proposer.propose(state.request_id, history, num_tokens, params, state.draft_generator,
                                         len(state.prompt_ids))
                        if num_tokens > 0 else empty_proposal())
            num_drafted = len(proposal.token_ids)
            logits = target.forward(state.request_id, history + proposal.token_ids, num_rows=num_drafted + 1)
            grammar = None
            if params.structured is not None:
                if grammars is None:
                    raise ValueError("a structured output needs the target's grammar matchers")
                grammar = grammars.synced(state.request_id, params.structured, state.output_ids)
            rows = target_rows(logits, params, state.eos_token_id, state.next_output_index,
                               history + proposal.token_ids, grammar)
            committed = accept_round(state, proposal, rows, verification)
            prefilled = True
            if committed:
                yield committed
    finally:
        target.release(state.request_id)
        if grammars is not None:
            grammars.release(state.request_id)
        if proposer is not None:
            proposer.release(state.request_id)
