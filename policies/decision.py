"""One policy decision from the cluster's load: depth per request class and replicas per pool.

`Decider` keeps only what hysteresis needs (the previous decision and when each pool's count
last changed); everything it knows about the cluster arrives in a `ClusterLoad`. Until a pool's
cost curve can be fitted (fewer than two distinct batch sizes measured) the depth stays at the
configured `default_k`: no opinion is better than a guess.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from specserve.common.messages import POOLS, REQUEST_CLASSES, PolicyDecision
from specserve.common.naming import policy_actor_name
from specserve.policies.cost_curve import fit_cost_curve
from specserve.policies.fan_out import fan_out_under_load
from specserve.policies.goodput import choose_depths
from specserve.policies.load import ClusterLoad
from specserve.policies.replicas import ScalingThresholds, decide_replicas


@dataclass(frozen=True)
class PolicySettings:
    """Bounds the policy works within; built from the specserve config (`from_config`)."""

    min_k: int = 1
    max_k: int = 8
    default_k: int = 4
    fan_out: int = 0                    # speculation.fan_out: pre-drafted blocks per request per round
    target_only_steps: int = 1          # speculation.target_only_steps: target passes a target-only round runs
    allow_target_only: bool = True
    target_bounds: tuple[int, int] = (1, 1)
    draft_bounds: tuple[int, int] | None = (1, 1)   # None: no draft pool (n-gram or target-only)
    thresholds: ScalingThresholds = field(default_factory=ScalingThresholds)
    report_ttl_s: float = 5.0
    decide_interval_s: float = 1.0
    actor_name: str = policy_actor_name("specserve-default")

    @classmethod
    def from_config(cls, config: Any) -> "PolicySettings":
        """From a `common.config.SpecServeConfig` (duck-typed: policies/ does not import cluster/)."""
        spec = config.speculation
        draft = config.draft_workers.replica_bounds if config.uses_draft_workers else None
        return cls(min_k=spec.min_draft_tokens, max_k=spec.max_draft_tokens, default_k=spec.num_draft_tokens,
                   fan_out=spec.fan_out if config.uses_draft_workers else 0, target_only_steps=spec.target_only_steps,
                   target_bounds=config.target_workers.replica_bounds, draft_bounds=draft,
                   actor_name=policy_actor_name(config.model_name))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PolicySettings":
        data = dict(data)
        data["thresholds"] = ScalingThresholds(**data.get("thresholds", {}))
        data["target_bounds"] = tuple(data["target_bounds"])
        data["draft_bounds"] = tuple(data["draft_bounds"]) if data.get("draft_bounds") else None
        return cls(**data)


class Decider:
    """Turns successive `ClusterLoad`s into `PolicyDecision`s with hysteresis; time is passed in."""

    def __init__(self, settings: PolicySettings) -> None:
        self.settings = settings
        self.decision = PolicyDecision({c: settings.default_k for c in REQUEST_CLASSES}, None, None, 0,
                                       ["no reports yet"])
        self._changed_at: dict[str, float] = {}

    def _depths(self, load: ClusterLoad, reasons: list[str]) -> tuple[dict[str, int], float | None]:
        s = self.settings
        target_curve = fit_cost_curve(load.cost_samples.get("target", ()))
        draft_curve = fit_cost_curve(load.cost_samples.get("draft", ())) if s.draft_bounds else None
        if target_curve is None or (s.draft_bounds is not None and draft_curve is None):
            reasons.append(f"depth: cost curves not measurable yet, K = {s.default_k}")
            return {c: s.default_k for c in REQUEST_CLASSES}, None
        target_replicas = load.pools["target"].replicas if "target" in load.pools else 1
        draft_replicas = load.pools["draft"].replicas if "draft" in load.pools else 1
        depths, goodput = choose_depths(load.classes, target_curve, draft_curve, target_replicas, draft_replicas,
                                        s.min_k, s.max_k, s.allow_target_only, self.decision.num_draft_tokens,
                                        overhead_s=load.round_overhead_s, target_only_steps=s.target_only_steps)
        reasons.append("depth: " + ", ".join(
            f"{c} K={depths[c]} (n={load.classes[c].active_requests}, alpha={load.classes[c].accept_rate:.2f})"
            for c in depths) + f", model goodput {goodput:.0f} tok/s")
        return depths, goodput

    def decide(self, load: ClusterLoad, now: float) -> PolicyDecision:
        reasons: list[str] = []
        depths, goodput = self._depths(load, reasons)
        bounds = {"target": self.settings.target_bounds}
        if self.settings.draft_bounds is not None:
            bounds["draft"] = self.settings.draft_bounds
        since = {pool: now - self._changed_at[pool] for pool in self._changed_at}
        previous = self.decision
        held = {"target": previous.target_replicas, "draft": previous.draft_replicas}
        wanted, replica_reasons = decide_replicas(load.pools, load.active_requests, bounds, since, held,
                                                  self.settings.thresholds)
        for pool in POOLS:
            if wanted.get(pool) is not None and wanted[pool] != getattr(previous, f"{pool}_replicas"):
                self._changed_at[pool] = now
        fan_out = fan_out_under_load(self.settings.fan_out, load.pools.get("draft"), self.settings.thresholds)
        if fan_out != self.settings.fan_out:
            reasons.append(f"fan-out {fan_out} of {self.settings.fan_out}: draft pool busy "
                           f"{load.pools['draft'].busy_share_all:.0%} with pre-drafts")
        candidate = PolicyDecision(depths, wanted.get("target"), wanted.get("draft"), previous.version,
                                   reasons + replica_reasons, goodput, fan_out)
        if not candidate.same_choice(previous):
            candidate = replace(candidate, version=previous.version + 1)
        self.decision = candidate
        return candidate
