"""What specserve's processes tell each other, as typed messages, and the constants both ends share.

Engines, routers and the policy actor run in separate Ray processes. Each message here is a
frozen dataclass that every side imports from this one module (as vLLM v1's engine messages
are): a field added on one side is seen on the other, and a misspelt one fails where the message
is built, not three hops later in a `.get()`. Ray pickles dataclasses as they are. This module
imports nothing of specserve's, so every process (the Serve controller's autoscaling policy
too) can read what it receives.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

RAY_NAMESPACE = "specserve"  # where the engines and the policy actor are named actors
POOLS = ("target", "draft")
REQUEST_CLASSES = ("greedy", "sampled")
MAX_DRAFT_TOKENS = 32  # the deepest K a config allows (common.config bounds its depths by it)
# An engine keeps the (new tokens, seconds) of its recent forwards and sends the ones not sent yet
# with each load report; the policy actor keeps more per pool: enough for a cost-curve fit,
# recent enough to follow the load.
ENGINE_COST_SAMPLES_KEPT = 64
POOL_COST_SAMPLES_KEPT = 512

CostSample = tuple[int, float]  # (new tokens a forward ran, its seconds)


@dataclass(frozen=True)
class CallSpan:
    """One engine call's moments inside the engine, perf_counter seconds (CLOCK_MONOTONIC, one
    clock for every process of a machine, so the caller can subtract its own send and receive
    times): it entered the engine, the forward that answered it began, it left. Entered to
    started is the wait in the batching loop, started to left the compute."""

    entered_s: float
    started_s: float
    left_s: float
    cached_tokens: int = 0   # tokens of the sequence the engine found in its prefix cache when it admitted it
    # A target run for an EAGLE-3 head: its aux layers' features of every position the answering
    # forward computed (decoding.target_features.TargetFeatures, on the CPU); the router keeps the
    # committed ones for the draft engine's next propose.
    features: Any = None

    @property
    def engine_s(self) -> float:
        return self.left_s - self.entered_s


@dataclass(frozen=True)
class HistoryUpdate:
    """What an engine call carries of a request's committed history (prompt + committed output):
    the tokens from `start` on, `start` being how many the sender last told this engine (0: the
    whole history, as to an engine that never saw the request), and a digest of the whole
    committed history (deployments.committed_history.history_digest) that the engine checks the
    history it builds against. A round so carries the few tokens committed since the last one,
    not the context. Speculative tokens (a draft block) never go in it: the calls carry them apart.
    A whole history (start 0) also carries the request's cache_salt, under which the engine keys
    the request's prefix-cache blocks (decoding.block_manager.BlockManager.salt_sequence)."""

    start: int
    new_tokens: tuple[int, ...]
    digest: int
    cache_salt: str | None = None

    @property
    def length(self) -> int:
        return self.start + len(self.new_tokens)


@dataclass(frozen=True)
class UnknownHistory:
    """An engine's answer instead of a result when it cannot rebuild the committed history an
    update describes: it never saw the request (a replacement after failover, a restarted
    engine), forgot it (an idle sequence), or holds fewer tokens than the update starts from, or
    the digest disagrees. The sender re-sends the whole history once (an update from 0)."""

    seq_id: str


@dataclass(frozen=True)
class DecodedSteps:
    """A target-only round's answer when the target decoded several tokens in it, each step from
    the token the step before drew: one verify answer per step, in order, exactly as that many
    rounds without a block would have answered (the same rows, the same draws from the request's
    stream). The router commits them in order and stops where the request finishes; the target
    stops early at a token that ends every request (EOS, a stop id)."""

    answers: tuple[Any, ...]


@dataclass(frozen=True)
class UnknownFeatures:
    """A draft engine's answer to a propose, instead of a block, when its EAGLE-3 head lacks the
    target's features from position `start` on (a replacement engine, or one that restarted): the
    router runs the round target-only, asking the target to compute the features again from
    there, and sends them with the next propose."""

    seq_id: str
    start: int


@dataclass(frozen=True)
class EngineEndpoint:
    """What a worker replica hands the router once per request: its engine's Ray actor (for
    health, stats and tests) and the address (host:port on the engine's node) its channel listens
    on, over which every round's calls go (common.channel)."""

    actor: Any
    address: str


@dataclass(frozen=True)
class StreamSink:
    """Where a router sends one request's chunks: an ingress replica's channel address and the
    stream's id there (deployments.streaming)."""

    address: str
    stream_id: int


@dataclass(frozen=True, slots=True)
class ChannelCall:
    """One call in a channel frame: `method` of the peer with `args`; its reply carries call_id.
    call_id None: a message that wants no reply (common.channel's `send`)."""

    call_id: int | None
    method: str
    args: tuple


@dataclass(frozen=True, slots=True)
class ChannelReply:
    """A peer's answer to one ChannelCall: its value, or the error the call raised."""

    call_id: int
    value: Any = None
    error: BaseException | None = None


@dataclass(frozen=True)
class KvUsage:
    """A paged engine's KV blocks (decoding.paged_cache) and the sequences it preempted."""

    blocks_used: int
    blocks_free: int
    block_size: int
    tokens_held: int
    bytes_reserved: int
    preemptions: int
    blocks_cached: int = 0           # unreferenced blocks kept for prefix caching (counted in blocks_free)
    prefix_cache_queries: int = 0    # tokens looked for in the prefix cache (new sequences, prefill chunks) ...
    prefix_cache_hits: int = 0       # ... and found there (vLLM's counters)

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else None


@dataclass(frozen=True)
class RankStats:
    """One rank of a tensor-parallel engine (docs/tensor-parallel.md): where it runs and what it
    holds: its weight shards, its KV pool's capacity (its heads only) and its process's own
    resident memory (RssAnon: without the mapped checkpoint's page cache)."""

    rank: int
    node_id: str | None
    gpu_ids: tuple[str, ...]
    weight_bytes: int
    kv_tokens: int
    kv_bytes_per_token: int
    private_rss_bytes: int
    error: str | None = None   # the rank could not be read (dead or stuck): its group is failing


@dataclass(frozen=True)
class EngineStats:
    """An engine's load, for the policy actor (sent about once a second), `specserve status` and
    benchmarks. Counters are cumulative; cost_samples are the recent forwards' costs (in a load
    report: those not reported before)."""

    pool: str
    replica: str
    sequences: int          # whose KV cache the engine holds
    free_slots: int
    queue_depth: int        # calls waiting for the next forward
    forwards: int
    batch_rows_total: int   # rows over all forwards: / forwards = mean batch size
    busy_s: float
    idle_s: float
    gpu_ids: tuple[str, ...] = ()
    speculative_s: float = 0.0  # of busy_s: forwards of optional work only (the draft's pre-drafts)
    node_id: str | None = None
    cost_samples: tuple[CostSample, ...] = ()
    kv: KvUsage | None = None  # None: the runner keeps no block pool
    ranks: tuple[RankStats, ...] = ()   # a tensor-parallel engine's ranks (rank 0 is this engine); () alone

    def to_dict(self) -> dict[str, Any]:
        """The flat JSON form `specserve status --json` shows (KV fields prefixed kv_)."""
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "kv"}
        data["gpu_ids"], data["cost_samples"] = list(self.gpu_ids), [list(s) for s in self.cost_samples]
        data["ranks"] = [{**asdict(rank), "gpu_ids": list(rank.gpu_ids)} for rank in self.ranks]
        if self.kv is not None:
            data.update({f"kv_{name}": value for name, value in asdict(self.kv).items()})
        return data


@dataclass(frozen=True)
class ClassReport:
    """A router's rounds of one request class so far: rounds that drafted, tokens drafted and
    accepted, and by draft position how many rounds reached it and accepted there
    (policies.acceptance.count_round_positions)."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    reached: tuple[int, ...] = ()
    accepted_at: tuple[int, ...] = ()


@dataclass(frozen=True)
class RouterReport:
    """A router's load, sent to the policy actor about once a second."""

    router: str
    active_requests: int
    active_by_class: Mapping[str, int]
    by_class: Mapping[str, ClassReport]
    round_overhead_s: float | None = None  # per round: RPC hops and the router's own work


@dataclass(frozen=True)
class PolicyDecision:
    """What routers and the Serve autoscaler read. A replica count of None means "no opinion:
    keep what runs" (nobody in that pool has reported yet). `version` counts changed decisions
    of one actor incarnation; it restarts at 0 with the actor, so never compare across restarts."""

    num_draft_tokens: Mapping[str, int]
    target_replicas: int | None
    draft_replicas: int | None
    version: int
    reasons: list[str] = field(default_factory=list)
    goodput_tokens_per_s: float | None = None   # the model's estimate for the chosen depths
    fan_out: int | None = None   # pre-drafted blocks per request per round (policies.fan_out); None: no opinion

    def replicas(self, pool: str) -> int | None:
        return self.target_replicas if pool == "target" else self.draft_replicas

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def same_choice(self, other: "PolicyDecision") -> bool:
        return (self.num_draft_tokens, self.target_replicas, self.draft_replicas, self.fan_out) == \
            (other.num_draft_tokens, other.target_replicas, other.draft_replicas, other.fan_out)


@dataclass
class PositionCounts:
    """Per draft position j (0 = the block's first token): rounds that drafted it and rounds that
    kept it. A round drafting K tokens and keeping a adds 1 to drafted[0..K-1] and accepted[0..a-1]."""

    drafted: list[int]
    accepted: list[int]

    @classmethod
    def of_round(cls, drafted: int, accepted: int) -> "PositionCounts":
        return cls([1] * drafted, [1] * accepted + [0] * (drafted - accepted))

    def add(self, other: "PositionCounts") -> None:
        width = max(len(self.drafted), len(other.drafted))
        for counts, more in ((self.drafted, other.drafted), (self.accepted, other.accepted)):
            counts.extend([0] * (width - len(counts)))
            for j, count in enumerate(more):
                counts[j] += count

    def minus(self, earlier: "PositionCounts") -> "PositionCounts":
        pad = [0] * len(self.drafted)
        return PositionCounts([a - b for a, b in zip(self.drafted, earlier.drafted + pad)],
                              [a - b for a, b in zip(self.accepted, earlier.accepted + pad)])

    @property
    def total_drafted(self) -> int:
        return sum(self.drafted)

    def acceptance(self) -> float | None:
        """Accepted / drafted over all positions (what `specserve status` shows)."""
        return sum(self.accepted) / self.total_drafted if self.total_drafted else None
