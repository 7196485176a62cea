"""Draft worker: proposes K tokens (and their processed q rows when sampling) per round."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from ray import serve

from decoding.model_runner import ModelRunner, check_compatible_paths
from decoding.proposers import DraftModelProposer, NgramProposer, Proposal
from decoding.sampling import SamplingParams, make_generator
from deployments.engine_host import EngineHost, to_wire


class DraftEngine:
    """Holds the proposer and, per request id, its KV cache and its seeded draft generator."""

    def __init__(self, proposer_kind: str, model_spec: dict | None, target_path: str) -> None:
        if proposer_kind == "ngram":
            self.proposer = NgramProposer()
        else:
            assert model_spec is not None, "a draft-model proposer needs a model spec"
            check_compatible_paths(model_spec["path"], target_path)  # fail start-up with a clear message
            self.proposer = DraftModelProposer(ModelRunner.from_spec(model_spec))
        self.generators: dict[str, torch.Generator] = {}

    def ping(self) -> bool:
        return True

    def prefill(self, seq_id: str, history: Sequence[int]) -> None:
        """Warm the draft's cache with the prompt while the target prefills it."""
        self.proposer.prefill(seq_id, history)

    def propose(self, seq_id: str, history: Sequence[int], num_tokens: int, params: SamplingParams,
                seed: int | None) -> tuple[Proposal, float]:
        """Up to num_tokens draft tokens continuing history, and the seconds spent drafting."""
        started = time.perf_counter()
        generator = self.generators.get(seq_id)
        if generator is None:
            generator = self.generators[seq_id] = make_generator(seed)
        proposal = self.proposer.propose(seq_id, history, num_tokens, params, generator)
        if proposal.probs is not None:
            proposal = Proposal(proposal.token_ids, to_wire(proposal.probs))
        return proposal, time.perf_counter() - started

    def release(self, seq_id: str) -> None:
        self.proposer.release(seq_id)
        self.generators.pop(seq_id, None)

    def active_sequences(self) -> list[str]:
        return sorted(self.generators)


@serve.deployment
class DraftWorker(EngineHost):
    engine_class = DraftEngine
