"""Every proposer `speculation.proposer` can name, and how the draft engine builds it.

Why a module of its own: the registry names every proposer, including those built on the drafting
primitives of decoding/proposers.py (the EAGLE-3 head's), so it sits above them all and imports
run one way. Adding a proposer is one entry in PROPOSERS (docs/extending.md).

The config validates `speculation.proposer` against this registry in every process that reads a
config (the ingress, the router, the CLI), so it imports no engine code: each builder imports its
proposer when a draft engine calls it, and only the draft engine pays for those imports.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specserve.decoding.proposers import DraftModelProposer, Proposer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProposerKind:
    """One way of proposing draft tokens, as config validation and the draft engine both see it.

    needs_model: it drafts with a draft checkpoint: the config must set `draft.path`, and the engine
    loads it into a runner (which draft training may hot-swap). build makes the proposer in the
    draft engine from the engine's scheduler over that runner, through which its forwards are planned
    (None when needs_model is False), the draft model's spec (None likewise) and the engine's options
    (`SpecServeConfig.engine_options`)."""

    needs_model: bool
    build: Callable[[Any, Mapping[str, Any] | None, Mapping[str, Any]], Proposer]
    description: str
    # It reads draft.path without a runner (an EAGLE-3 head: the config must set it, the engine
    # hands the spec to build).
    needs_path: bool = False


def _draft_model_proposer(runner: Any, model_spec: Mapping[str, Any] | None,
                          engine_options: Mapping[str, Any]) -> DraftModelProposer:
    from specserve.decoding.grammar import GrammarMatchers
    from specserve.decoding.proposers import SAGUARO_LOWERED, DraftModelProposer, SaguaroSampling

    assert runner is not None and model_spec is not None, "a draft-model proposer needs its runner and spec"
    grammars = GrammarMatchers.for_runner(runner, model_spec.get("tokenizer_path") or model_spec["path"])
    downweight = engine_options.get("saguaro_downweight")
    saguaro = None if downweight is None or downweight >= 1.0 else SaguaroSampling(SAGUARO_LOWERED, downweight)
    return DraftModelProposer(runner, grammars, engine_options.get("draft_top_k"), saguaro)


def _eagle3_proposer(runner: Any, model_spec: Mapping[str, Any] | None, engine_options: Mapping[str, Any]):
    """The head in model_spec["path"] over the target's embeddings, read from model_spec["target_path"]
    (the draft engine loads those, not the target's layers)."""
    from specserve.decoding.checkpoint import resolve_device, resolve_dtype
    from specserve.decoding.eagle3_checkpoint import load_eagle3_head, target_embeddings
    from specserve.decoding.eagle3_proposer import Eagle3Proposer

    assert model_spec is not None and "target_path" in model_spec, "a head needs its spec and its target's path"
    device = resolve_device(model_spec["device"])
    target = target_embeddings(model_spec["target_path"],
                               resolve_dtype(model_spec["dtype"], model_spec["target_path"], device), device)
    loaded = load_eagle3_head(model_spec["path"], target)
    steps = loaded.head.compile_steps(model_spec.get("enforce_eager"), model_spec.get("inductor_options"),
                                      model_spec["path"])
    logger.info("EAGLE-3 head %s: %s", model_spec["path"], steps)
    return Eagle3Proposer(loaded, engine_options.get("draft_top_k"))


def _ngram_proposer(runner: Any, model_spec: Mapping[str, Any] | None, engine_options: Mapping[str, Any]):
    from specserve.decoding.proposers import NgramProposer

    return NgramProposer()


# Every proposer `speculation.proposer` can name: an entry here is all a new one needs (the config
# accepts its name, the draft engine builds it). NO_PROPOSER, target-only, is the absence of one.
PROPOSERS: dict[str, ProposerKind] = {
    "draft": ProposerKind(True, _draft_model_proposer, "a draft model drafting autoregressively (draft.path)"),
    "eagle3": ProposerKind(False, _eagle3_proposer, "an EAGLE-3 head (draft.path) fed the target's hidden features "
                           "each round (docs/eagle3.md)", needs_path=True),
    "ngram": ProposerKind(False, _ngram_proposer,
                          "prompt lookup: continue a suffix that occurred earlier in the text, no model"),
}
NO_PROPOSER = "none"


def proposer_kind(name: str) -> ProposerKind:
    """The registered proposer called name; a ValueError naming the choices for any other name."""
    if name not in PROPOSERS:
        raise ValueError(f"unknown proposer {name!r}: choose one of {sorted(PROPOSERS)} or {NO_PROPOSER!r}")
    return PROPOSERS[name]
