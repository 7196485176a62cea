"""The one configuration object: validated at the edge, then passed whole to every deployment.

Loaded from YAML (``specserve serve --config FILE``) and/or environment variables
``SPECSERVE__SECTION__FIELD=value`` (double underscore = nesting), env winning over the file.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_serializer, field_validator, model_validator

from specserve.common.messages import MAX_DRAFT_TOKENS
from specserve.common.naming import draft_trainer_name, policy_actor_name
from specserve.decoding.proposer_registry import NO_PROPOSER, PROPOSERS, proposer_kind
from specserve.decoding.token_map import AUTO_TOKEN_MAP, served_token_map

MAX_FAN_OUT = 16  # pre-drafted blocks per request per round: past this the pre-drafts crowd out the rounds

PROJECT_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODELS_DIR = PROJECT_ROOT / "models" / "default"
ENV_PREFIX = "SPECSERVE__"
RAW_ENV_FIELDS = {("auth", "api_keys")}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSpec(_Strict):
    """One Hugging Face causal LM on local disk."""

    path: str
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="auto: the checkpoint's torch_dtype on a GPU, float32 on CPU (docs/real-checkpoints.md)")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$",
                        description="auto: cuda when the worker has a GPU (num_gpus > 0), else cpu; "
                        "cuda is the engine's own GPU (Ray shows it as cuda:0; other indices are refused)")
    max_model_len: int | None = Field(None, ge=2, description="longest prompt + completion served; "
                                      "default: the model's context (max_position_embeddings)")
    torch_threads: int = Field(1, ge=1, description="intra-op threads per worker on CPU")
    max_sequences: int = Field(256, ge=1, description="KV caches a worker holds at once")
    lean_forward: bool = Field(True, description="run decoding.lean_forward for Llama-shaped models "
                                                 "(false: transformers' own forward)")
    enforce_eager: bool | None = Field(None, description="true: run the forward uncompiled (vLLM's name); false: "
                                       "torch.compile it (CUDA graphs on a GPU, artifacts cached on disk); unset: "
                                       "compiled on a GPU, eager on CPU, where compiling costs minutes of start-up "
                                       "for little (docs/performance.md)")
    inductor_options: dict[str, bool | int | float | str] | None = Field(
        None, description="inductor's settings for every compile of the forward (torch.compile's options, as "
        "vLLM's inductor_compile_config), e.g. {\"loop_ordering_after_fusion\": false}; unset: inductor's "
        "defaults, retried with its loop-rewriting fusions off where it cannot generate the kernels (docs/gpu.md)")
    kv_cache_memory_gb: float = Field(4.0, gt=0, description="KV cache budget (GiB) per engine replica on CPU "
                                      "(per rank of a tensor-parallel engine, whose pool holds its heads only); "
                                      "the pool grows with use up to it (docs/kv-memory.md)")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="on CUDA: share of the engine's part "
                                          "of the device (num_gpus) that weights, activations and KV may use; "
                                          "KV gets the rest (as vLLM)")
    null_forward_agreement: float | None = Field(None, ge=0, le=1, description="benches of the stack only: the "
                                                 "model is not computed; its logits follow a hashed rule that a "
                                                 "runner with this setting predicts at this rate (a draft at a, its "
                                                 "target at 1: acceptance a; decoding/null_forward.py)")
    token_map: str | None = Field(AUTO_TOKEN_MAP, description="a draft model's only: a file of the token ids it "
                                  "may propose (a JSON list, or a tensor saved with torch.save); its LM head scores "
                                  "only those in steps whose rows are all greedy: a cheaper step for a little "
                                  "acceptance (FR-Spec; docs/token-map.md). auto: the draft folder's token_map.json "
                                  "where it has one (the default pair's draft does) and the draft is a draft model on "
                                  "one rank; null: none")
    token_map_sampled: bool = Field(False, description="score sampled rows over the token map too (SGLang's "
                                    "behaviour): cheaper steps for all rows, but a sampled row loses acceptance on "
                                    "the target's mass outside the map")
    prefix_caching: bool = Field(True, description="keep finished sequences' full KV blocks findable by their "
                                 "tokens, so a shared prefix (system prompt, n choices, a chat's earlier turns) is "
                                 "not prefilled again; evicted LRU when the pool needs room (as vLLM; docs/kv-memory.md)")

    @field_validator("device")
    @classmethod
    def _one_visible_gpu(cls, device: str) -> str:
        """Ray shows each engine only the GPU it was given, as cuda:0: any other index names a
        device the engine cannot see (or, outside Ray, one it was not given)."""
        if device.startswith("cuda:") and device != "cuda:0":
            raise ValueError(f"device {device!r}: Ray gives each engine its own GPU and shows it as cuda:0, so "
                             "another index names a GPU the engine cannot see. Set device: cuda (or auto) and "
                             "choose GPUs with num_gpus / resources (or CUDA_VISIBLE_DEVICES on the node)")
        return device


class WorkerResources(_Strict):
    """Replicas and resources of one deployment (the engine actor of a worker gets them; with
    tensor_parallel_size N, each of its N rank actors does)."""

    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    tensor_parallel_size: int = Field(1, ge=1, description="workers only: each replica's engine is a group of this "
                                      "many rank actors (one GPU each on a GPU cluster, on one node), the model's "
                                      "heads and MLP columns split among them (docs/tensor-parallel.md)")
    tensor_parallel_timeout_s: float = Field(3600.0, gt=0, description="workers only: how long a rank of a "
                                             "tensor-parallel group waits for the others in a collective; it "
                                             "must cover the slowest rank's shard load (the first collective "
                                             "after loading waits for it)")
    resources: dict[str, float] = Field(default_factory=dict,
                                        description="custom Ray resources, e.g. to pin engines to a node group")
    max_ongoing_requests: int = Field(256, ge=1)
    min_replicas: int | None = Field(None, ge=1, description="with max_replicas: Serve autoscales the pool")
    max_replicas: int | None = Field(None, ge=1)
    upscale_delay_s: float = Field(10.0, ge=0, description="Serve waits this long before adding a replica")
    downscale_delay_s: float = Field(60.0, ge=0, description="Serve waits this long before removing one")
    node_memory_gb: float = Field(16.0, gt=0, description="KubeRay: memory of this pool's pods; on a GPU node "
                                  "at least the checkpoint's size (weights are read through host memory)")

    @model_validator(mode="after")
    def _replica_bounds(self) -> "WorkerResources":
        low, high = self.replica_bounds
        if low > high:
            raise ValueError(f"need min_replicas <= max_replicas, got {low} > {high}")
        return self

    @property
    def replica_bounds(self) -> tuple[int, int]:
        """(min, max) replicas; unset bounds default to num_replicas."""
        low = self.min_replicas if self.min_replicas is not None else min(self.num_replicas, self.max_replicas or self.num_replicas)
        high = self.max_replicas if self.max_replicas is not None else max(self.num_replicas, low)
        return low, high

    @property
    def initial_replicas(self) -> int:
        """Replicas at start: num_replicas, clamped into the bounds."""
        low, high = self.replica_bounds
        return min(high, max(low, self.num_replicas))

    @property
    def autoscaling(self) -> bool:
        """Autoscaled when bounds are set and differ; otherwise a fixed pool."""
        low, high = self.replica_bounds
        return low < high


class SpeculationSpec(_Strict):
    """How draft tokens are proposed and how deep each round goes.

    K adapts per request between min and max from the request's own acceptance rate
    (policies.depth); ``adaptive: false`` pins it at ``num_draft_tokens``.
    """

    proposer: str = Field("draft", description="; ".join(
        [f"`{name}`: {kind.description}" for name, kind in PROPOSERS.items()] + [f"`{NO_PROPOSER}`: target-only"]))
    num_draft_tokens: int = Field(4, ge=0, le=MAX_DRAFT_TOKENS)
    min_draft_tokens: int = Field(1, ge=0, le=MAX_DRAFT_TOKENS)
    max_draft_tokens: int = Field(8, ge=0, le=MAX_DRAFT_TOKENS)
    adaptive: bool = True
    draft_cost_ratio: float = Field(0.15, gt=0, le=1, description="draft step / target pass latency until measured")
    fan_out: int = Field(3, ge=0, le=MAX_FAN_OUT, description="blocks the draft engine pre-drafts per request "
                         "while the target verifies a round, for the verification's likely outcomes (the speculation "
                         "cache, docs/speculation-cache.md; a draft model or an EAGLE-3 head); the policy actor lowers it as the draft "
                         "pool fills. 0: plain rounds")
    fan_out_max_batch: int = Field(1, ge=1, description="pre-draft only while a router has at most this many "
                                   "requests in flight (Saguaro's batch-size fallback): where draft and target share "
                                   "a device or a CPU, pre-drafts for a batch slow the target more than hits save "
                                   "(docs/speculation-cache.md); raise it when the draft has its own GPU")
    fan_out_measured: bool = Field(True, description="keep the fan-out only where a request class's rounds "
                                   "measure faster with it than without (a few rounds in twenty run the other way to "
                                   "keep both measured): where draft and target share cores or a device, pre-drafts "
                                   "slow the target's verify. false: the fan-out as the other gates set it "
                                   "(docs/speculation-cache.md)")
    saguaro_downweight: float = Field(1.0, gt=0, le=1, description="with a fan-out, a sampled draft draws "
                                      "from its row with its likeliest tokens scaled by this (Saguaro sampling): a "
                                      "rejection's recovered token then falls on the tokens pre-drafted for far more "
                                      "often, for some acceptance (0.05 gave the measured hits). Exact for any value; "
                                      "1 (the default, until tokens/s shows it pays): off (docs/speculation-cache.md)")
    draft_top_k: int = Field(8192, ge=1, description="a sampled draft token is drawn from at most this many of "
                             "its row's most likely tokens, leaving out those under a millionth of the likeliest's "
                             "probability (fewer where the request's top-k / top-p cut it shorter; the whole row, "
                             "tail and all, where the vocabulary has no more), and that q goes to the "
                             "target as (ids, probs), 8 bytes a token of it (4 for a whole row). Exact for any "
                             "value; the cut costs acceptance up to the mass it removes, which a small draft "
                             "spreads thinly over thousands of tokens (docs/sampling.md#how-wide-the-drafts-q-is)")
    target_only_steps: int = Field(4, ge=1, le=64, description="a round without a draft block (target-only: "
                                   "no proposer, a lost draft, or K chosen 0 under load) decodes up to this many "
                                   "tokens in the target engine before it answers, as vLLM's multi-step scheduling "
                                   "does: the router, the channel and the stream pay once for them, and tokens "
                                   "stream in chunks of this many. The same tokens either way (greedy and seeded); "
                                   "1: one token a round")
    verification: Literal["block", "token"] = Field(
        "block", description="how a sampled request's draft-model block is verified: jointly (block verification, "
        "docs/block-verification.md) or token by token; greedy requests and n-gram drafts are always token-wise")

    @field_validator("proposer")
    @classmethod
    def _registered_proposer(cls, name: str) -> str:
        if name != NO_PROPOSER:
            proposer_kind(name)   # raises, naming the choices
        return name

    @property
    def needs_draft_model(self) -> bool:
        """The proposer drafts with a draft checkpoint (draft.path), rather than without a model or not at all."""
        return self.proposer != NO_PROPOSER and proposer_kind(self.proposer).needs_model

    @property
    def needs_draft_path(self) -> bool:
        """The proposer reads draft.path: a draft model, or an EAGLE-3 head."""
        if self.proposer == NO_PROPOSER:
            return False
        kind = proposer_kind(self.proposer)
        return kind.needs_model or kind.needs_path

    @property
    def draft_kind(self) -> str:
        """What drafts, in words (the start-up line, `specserve status`)."""
        return {"draft": "draft model", "eagle3": "EAGLE-3 head", "ngram": "n-gram",
                NO_PROPOSER: "none (target-only)"}.get(self.proposer, self.proposer)

    @model_validator(mode="after")
    def _bounds(self) -> "SpeculationSpec":
        if not self.min_draft_tokens <= self.num_draft_tokens <= self.max_draft_tokens:
            raise ValueError("need min_draft_tokens <= num_draft_tokens <= max_draft_tokens")
        return self


class LimitsSpec(_Strict):
    max_tokens: int | None = Field(None, ge=1, description="largest max_tokens a request may ask for; "
                                   "default: the target's max_model_len")
    default_max_tokens: int | None = Field(None, ge=1, description="max_tokens of a request that sets none; "
                                           "default: as vLLM, chat runs to the rest of the context, "
                                           "completions make 16 (OpenAI's default)")
    max_prompt_chars: int = Field(100_000, ge=1)
    request_timeout_s: float = Field(600.0, gt=0, description="a request running longer ends with "
                                     "finish_reason 'timeout' and the tokens it has")
    max_active_requests: int = Field(128, ge=1, description="requests a router runs at once")
    max_queued_requests: int = Field(256, ge=0, description="requests waiting for room; more get 503")
    queue_timeout_s: float = Field(30.0, gt=0, description="how long a request waits for room before 503")
    shutdown_grace_s: float = Field(25.0, ge=0, description="on SIGTERM or Ctrl-C, how long requests in flight "
                                    "get to finish (below Kubernetes' default 30 s termination grace)")
    engine_wait_s: float = Field(30.0, gt=0, description="how long a request waits for a target replica "
                                 "before 503")
    draft_wait_s: float = Field(2.0, gt=0, description="how long a request waits for a draft replica "
                                "before it goes target-only")


class BatchingSpec(_Strict):
    """How an engine batches the calls waiting on it (continuous batching of rounds)."""

    max_batch_rows: int = Field(64, ge=1, description="most sequences in one forward")
    prefill_token_budget: int = Field(2048, ge=1, description="prompt tokens prefilled per engine iteration "
                                      "(chunked prefill, vLLM's default: a long prompt never stalls running "
                                      "rounds for long)")
    admission_timeout_s: float = Field(30.0, gt=0, description="how long a new sequence waits to be admitted "
                                       "(a free KV slot and blocks) before the request gets 503")
    idle_sequence_ttl_s: float = Field(900.0, gt=0, description="a KV slot untouched this long is freed "
                                       "(a last safety net for slots nobody released)")


class HttpSpec(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    stream_interval_ms: float = Field(0.0, ge=0, le=1000, description="least time between two streamed "
                                      "chunks of one request after the first (tokens of rounds in between "
                                      "are merged; 0 = a chunk per round). Fewer chunks cost the router, "
                                      "ingress and proxy less CPU per token, as vLLM's --stream-interval")


KEY_DIGEST_PREFIX = "sha256:"


class AuthSpec(_Strict):
    """API keys for the HTTP API (none: the API is open).

    Keys are SecretStr, so they never print, and they are serialised only as SHA-256 digests
    ("sha256:<hex>"): the config handed to the deployments and the YAML of `serve-config` never
    hold a key in clear. An entry already written as "sha256:<hex>" is taken as a digest, so a
    config file need not hold keys either. ``SPECSERVE__AUTH__API_KEYS=a,b`` gives two keys.
    """

    api_keys: list[SecretStr] = Field(default_factory=list, description="accepted bearer keys, or their sha256: digests")

    @field_validator("api_keys", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        if isinstance(value, str | SecretStr):
            raw = value.get_secret_value() if isinstance(value, SecretStr) else value
            return [key.strip() for key in raw.split(",") if key.strip()]
        return value

    @field_serializer("api_keys")
    def _as_digests(self, keys: list[SecretStr]) -> list[str]:
        return self.key_digests()

    def key_digests(self) -> list[str]:
        """ "sha256:<hex>" of every key (digests given as such are kept)."""
        return [key_digest(key.get_secret_value()) for key in self.api_keys]


def key_digest(key: str) -> str:
    """The form a key is stored and compared in: "sha256:<hex>" (a digest is its own digest)."""
    return key if key.startswith(KEY_DIGEST_PREFIX) else hash_key(key)


def hash_key(key: str) -> str:
    """ "sha256:<hex>" of key, whatever it looks like: what a presented bearer key is compared as
    (a client presenting a digest must not pass as the key it digests)."""
    return KEY_DIGEST_PREFIX + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


class ObservabilitySpec(_Strict):
    """Where the local cluster serves its Prometheus metrics (the KubeRay head uses 8080 too)."""

    metrics_export_port: int = Field(8080, ge=0, le=65535,
                                     description="Ray's Prometheus endpoint on this node; 0 = any free port")
    metrics_report_interval_ms: int = Field(10_000, ge=100, description="how often workers push metrics to it")


class DraftTrainingSpec(_Strict):
    """The draft learns from served traffic (docs/online-learning.md): capture the target's
    verify rows, distil a copy of the draft when the cluster has slack, canary, hot-swap.

    Off by default. Nothing is written to disk unless capture_dir is set, except the trained
    draft versions, under versions_dir (engines get them through Ray's object store, or read a
    shared versions_dir)."""

    enabled: bool = Field(False, description="capture verify rows and train the draft online")
    capture_dir: str | None = Field(None, description="also persist captured rows here (users' traffic: "
                                    "unset, nothing is written); `specserve distill-draft --from-capture` reads it")
    versions_dir: str | None = Field(None, description="where trained draft versions are written before they "
                                     "are offered; default: a fresh temporary directory on the trainer's node, and "
                                     "draft engines on every node get each version through Ray's object store. Set "
                                     "to a path every draft node reads (a shared volume) to have engines read it "
                                     "there instead")
    keep_versions: int = Field(3, ge=2, description="trained versions kept on disk and in the object store "
                               "(the newest, and always the serving one); older ones are deleted (a 1B draft is "
                               "about 2.5 GB a version)")
    max_positions: int = Field(200_000, ge=1, description="captured drafted positions kept in memory (oldest go first)")
    sample_every: int = Field(4, ge=1, description="capture one verified round in this many")
    top_k: int = Field(32, ge=1, le=4096, description="target log-probabilities kept per drafted position "
                       "(the rest as one residual mass)")
    min_new_positions: int = Field(2_000, ge=1, description="captured positions since the last training "
                                   "before training again")
    max_context: int = Field(256, ge=8, description="context tokens a training position keeps")
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate of distillation")
    epochs: int = Field(4, ge=1)
    batch_size: int = Field(32, ge=1, description="positions per optimizer step")
    canary_margin: float = Field(0.01, ge=0, description="a candidate's held-back expected acceptance must "
                                 "beat the serving draft's by this much")
    rollback_margin: float = Field(0.05, ge=0, description="after a swap, live acceptance this much below the "
                                   "previous version's rolls the swap back")
    rollback_min_drafted: int = Field(500, ge=1, description="drafted tokens on a new version before it is judged")
    slack_max_active_requests: int | None = Field(None, ge=0, description="also require at most this many "
                                                  "requests in flight for slack (0: train only when idle, every "
                                                  "request stops a pass); unset: slack is the target pool's busy "
                                                  "share alone, so a trickle of traffic still gets new versions")
    slack_max_busy_share: float = Field(0.5, gt=0, le=1, description="the cluster has slack (training may run) "
                                        "while the target pool is busy at most this share of the time; a trainer "
                                        "with a GPU of its own (num_gpus >= 1) trains beside serving regardless")
    num_cpus: float = Field(1.0, ge=0, description="CPUs of the trainer actor")
    num_gpus: float = Field(0.0, ge=0, description="GPUs of the trainer actor")
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources of the trainer "
                                        "(e.g. to place it with the draft pool)")


class SpecServeConfig(_Strict):
    """Everything a deployment needs; the single source of truth."""

    model_name: str = "specserve-default"
    target: ModelSpec = ModelSpec(path=str(DEFAULT_MODELS_DIR / "target"))
    draft: ModelSpec | None = ModelSpec(path=str(DEFAULT_MODELS_DIR / "draft"))
    tokenizer_path: str | None = Field(None, description="defaults to the target's path")
    chat_template: str | None = Field(None, description="a Jinja chat template, or the path of a file holding "
                                      "one, used instead of the tokenizer's (vLLM's --chat-template)")
    speculation: SpeculationSpec = SpeculationSpec()
    limits: LimitsSpec = LimitsSpec()
    batching: BatchingSpec = BatchingSpec()
    http: HttpSpec = HttpSpec()
    auth: AuthSpec = AuthSpec()
    ingress: WorkerResources = WorkerResources(num_cpus=0.25)
    router: WorkerResources = WorkerResources(num_cpus=0.25)
    target_workers: WorkerResources = WorkerResources()
    draft_workers: WorkerResources = WorkerResources()
    observability: ObservabilitySpec = ObservabilitySpec()
    draft_training: DraftTrainingSpec = DraftTrainingSpec()

    @model_validator(mode="after")
    def _draft_needed(self) -> "SpecServeConfig":
        if self.speculation.needs_draft_path and self.draft is None:
            raise ValueError(f"speculation.proposer {self.speculation.proposer!r} needs a draft model (set draft.path)")
        if self.draft_training.enabled and (self.draft is None or not self.speculation.needs_draft_model):
            raise ValueError("draft_training.enabled needs a draft model (speculation.proposer 'draft')")
        return self

    @model_validator(mode="after")
    def _token_map_on_a_draft_model(self) -> "SpecServeConfig":
        if self.target.token_map not in (None, AUTO_TOKEN_MAP) or self.target.token_map_sampled:
            raise ValueError("target.token_map: a token map restricts what a draft proposes; the target scores "
                             "every token (set draft.token_map)")
        if self.draft is not None and self.draft.token_map_sampled and self.draft.token_map is None:
            raise ValueError("draft.token_map_sampled: scores sampled rows over a token map, but draft.token_map "
                             "is null")
        # auto asks for the folder's map only where it can serve (decoding.token_map.folder_token_map).
        if self.draft is not None and self.draft.token_map not in (None, AUTO_TOKEN_MAP):
            if not self.speculation.needs_draft_model:
                raise ValueError(f"draft.token_map needs a draft model (speculation.proposer 'draft'), not "
                                 f"{self.speculation.proposer!r}")
            if self.draft_workers.tensor_parallel_size > 1:
                raise ValueError("draft.token_map needs draft_workers.tensor_parallel_size 1")
        return self

    @model_validator(mode="after")
    def _tensor_parallel_on_engines_only(self) -> "SpecServeConfig":
        for name in ("ingress", "router"):
            if getattr(self, name).tensor_parallel_size != 1:
                raise ValueError(f"{name}.tensor_parallel_size must be 1: only target and draft engines are split")
        if self.draft_training.enabled and self.draft_workers.tensor_parallel_size > 1:
            # A trained version is copied into one process's serving weights: not yet per rank's shards.
            raise ValueError("draft_training.enabled needs draft_workers.tensor_parallel_size 1")
        if self.draft_workers.tensor_parallel_size > 1 and not self.speculation.needs_draft_model:
            raise ValueError("draft_workers.tensor_parallel_size > 1 needs a draft model (speculation.proposer "
                             "'draft'): an n-gram proposer has no weights to split")
        return self

    @model_validator(mode="after")
    def _device_matches_gpus(self) -> "SpecServeConfig":
        pools = [("target", self.target, "target_workers", self.target_workers)]
        if self.draft is not None and self.speculation.needs_draft_model:
            pools.append(("draft", self.draft, "draft_workers", self.draft_workers))
        for role, spec, pool, workers in pools:
            if spec.device.startswith("cuda") and workers.num_gpus == 0:
                raise ValueError(f"{role}.device is {spec.device!r} but {pool}.num_gpus is 0: Ray gives the worker "
                                 f"no GPU. Set {pool}.num_gpus (e.g. 1) or {role}.device: auto")
            if spec.device == "cpu" and workers.num_gpus > 0:
                raise ValueError(f"{role}.device is 'cpu' but {pool}.num_gpus is {workers.num_gpus:g}: the GPU "
                                 f"would sit idle. Set {role}.device: auto (or cuda) or {pool}.num_gpus: 0")
        return self

    @property
    def resolved_tokenizer_path(self) -> str:
        return self.tokenizer_path or self.target.path

    @property
    def draft_token_map(self) -> str | None:
        """The file of the token map the draft model serves with, or None (draft.token_map with
        auto resolved: the draft folder's own, where it drafts as a draft model on one rank)."""
        if self.draft is None or not self.speculation.needs_draft_model:
            return None
        return served_token_map(self.draft.token_map, self.draft.path, self.draft_workers.tensor_parallel_size == 1)

    @property
    def resolved_chat_template(self) -> str | None:
        """chat_template's text (read from the file when it names one), or None: the tokenizer's."""
        if self.chat_template is None:
            return None
        candidate = Path(self.chat_template)
        if "{" not in self.chat_template and candidate.is_file():
            return candidate.read_text()
        return self.chat_template

    @property
    def uses_draft_workers(self) -> bool:
        return self.speculation.proposer != NO_PROPOSER

    def engine_options(self) -> dict[str, Any]:
        """What an engine's batching loop needs: the batching section plus the largest step a
        round can bring (a block drafted ahead carries its bonus guess: max depth + 2 tokens)."""
        return {**self.batching.model_dump(), "max_step_tokens": max(16, self.speculation.max_draft_tokens + 2),
                "policy_actor": policy_actor_name(self.model_name), "draft_top_k": self.speculation.draft_top_k,
                "saguaro_downweight": self.speculation.saguaro_downweight if self.speculation.fan_out else 1.0,
                "draft_trainer": draft_trainer_name(self.model_name) if self.draft_training.enabled else None}


def _set_nested(tree: dict[str, Any], dotted: list[str], value: Any) -> None:
    for key in dotted[:-1]:
        node = tree.get(key)
        if not isinstance(node, dict):
            node = tree[key] = {}
        tree = node
    tree[dotted[-1]] = value


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """``SPECSERVE__SPECULATION__NUM_DRAFT_TOKENS=6`` -> {"speculation": {"num_draft_tokens": 6}}.

    Values are parsed as YAML scalars so numbers and booleans keep their types, except secrets
    (RAW_ENV_FIELDS), which YAML would mangle (digits become numbers, " #" starts a comment).
    """
    overrides: dict[str, Any] = {}
    for name, raw in environ.items():
        if name.startswith(ENV_PREFIX):
            path = name[len(ENV_PREFIX):].lower().split("__")
            _set_nested(overrides, path, raw if tuple(path) in RAW_ENV_FIELDS else yaml.safe_load(raw))
    return overrides


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(path: str | Path | None = None, environ: Mapping[str, str] | None = None) -> SpecServeConfig:
    """File (optional) + environment overrides -> validated config."""
    data: dict[str, Any] = {}
    if path is not None:
        loaded = yaml.safe_load(Path(path).read_text())
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: expected a YAML mapping at the top level")
        data = loaded
    data = _merge(data, env_overrides(os.environ if environ is None else environ))
    return SpecServeConfig.model_validate(data)
