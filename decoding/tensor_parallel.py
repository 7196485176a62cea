"""Tensor parallelism for one engine: N processes, one per rank, each holding its slice of every
layer, joined by torch.distributed (gloo on CPU, NCCL on CUDA). Ray-free: deployments/engine_group.py
places the ranks; this module joins them, loads each rank's shards and keeps the ranks in step.

Sharding is transformers' own tensor-parallel plan (`DistributedConfig(tp_size=N)`, the plan each
architecture's config carries as `base_model_tp_plan`): q/k/v and gate/up split by columns (heads),
o/down by rows followed by an all-reduce, the embedding and LM head split by vocabulary with the
logits gathered whole on every rank. Each rank reads only its slices of the safetensors files. Why
not our own column/row split: the plan already exists for every architecture transformers serves
with TP (Llama, Qwen2/3, Mistral, Gemma, MoE), and it runs with gloo on CPU, so a second copy of it
would only be a second thing to keep right (docs/tensor-parallel.md).

Keeping ranks in step: rank 0 holds the engine, and with it the only block manager (the
scheduler's, decoding.block_manager); its runner is a `MirroredRunner` that broadcasts each planned
step (decoding.block_manager.StepPlan: the tokens to run, positions, block tables, copies; never a
token history) to the followers before running it, and each follower (`follow`) runs the same plan
on its own pool and computes no logits rows of its own to answer with. So every rank writes the
same blocks and the collectives inside the forward meet. A rank's pool holds its own heads only
(BatchedModelRunner sizes it per rank).

Failure: the plans go over a control group whose timeout is long (an idle follower waits there
between steps), the forward's collectives over the default group, whose timeout (`timeout_s`, a
setting: tensor_parallel_timeout_s) must cover the slowest rank's shard load, since the first
collective after the load waits for it (transformers' own default is hours; ours is an hour). Past
it, a failed collective raises GroupBrokenError and the engine ends its process
(deployments.engine_group) so the router fails over as for a lost engine.
"""

from __future__ import annotations

import datetime
import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# A collective waits at most this long for the other ranks by default: the first one after the
# load waits for the slowest rank's shards (a 70B checkpoint from network storage takes many
# minutes); a forward of the largest planned batch takes well under a second.
DEFAULT_GROUP_TIMEOUT_S = 3600.0
# An idle follower waits this long for rank 0's next call (effectively forever; a dead rank 0
# closes the connection, which ends the wait at once).
IDLE_TIMEOUT_S = 7 * 24 * 3600.0
# The runner calls that write KV: a planned step; everything else only reads, so followers need only it.
# (tests/test_tensor_parallel.py fails on a public runner method named in neither list.)
MIRRORED_CALLS = ("run",)
READ_ONLY_CALLS = ("serve_as", "from_model", "weights_mismatch", "features")
# Calls a group never takes: a trained draft version's weights are whole, not a rank's shard, and
# the config refuses draft training on a split draft (common.config).
UNSPLIT_CALLS = ("load_weights",)
_STOP = "stop"


class GroupBrokenError(RuntimeError):
    """A collective of the tensor-parallel group failed (a rank died or stopped answering): the
    group cannot serve anymore and must be replaced."""


@dataclass(frozen=True)
class TensorParallelRank:
    """One process's place in a group: rank, group size, and where the group meets (the
    `host:port` of the TCPStore its host process serves: `host_store`)."""

    rank: int
    size: int
    store_address: str
    timeout_s: float = DEFAULT_GROUP_TIMEOUT_S   # how long a collective waits for the other ranks


def host_store(host: str, timeout_s: float = DEFAULT_GROUP_TIMEOUT_S) -> tuple[Any, str]:
    """A torch.distributed TCPStore for one group, served by the calling process on a port the OS
    picks while binding it (no port picked first and bound later, which another process on a busy
    node could take in between); -> (the store, which must live as long as the group, its
    address). The worker replica hosts its engine group's; a test, its processes'."""
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return store, f"{host}:{store.port}"


def backend_for(device: str) -> str:
    """NCCL on CUDA (written with care, never run here: no GPU), gloo otherwise."""
    return "nccl" if str(device).startswith("cuda") else "gloo"


# This process's control group, once joined: torch.distributed's groups are process-wide, and a
# process is one rank of one group at most.
_control_group: list[Any] = []


def join_group(member: TensorParallelRank, device: str = "cpu") -> Any:
    """Join the group (blocks until every rank has joined); -> the control group (gloo, on CPU
    whatever the device) the runner calls and load-time agreements travel over. The default
    process group carries the model's collectives (NCCL on CUDA)."""
    host, port = member.store_address.rsplit(":", 1)
    timeout = datetime.timedelta(seconds=member.timeout_s)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    dist.init_process_group(backend_for(device), store=store, rank=member.rank, world_size=member.size,
                            timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=IDLE_TIMEOUT_S))
    _control_group[:] = [control]
    return control


def check_divisible(config, size: int) -> None:
    """ValueError unless the attention and KV heads split evenly over size ranks (the plan splits
    heads, never a head)."""
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    if heads % size or kv_heads % size:
        raise ValueError(f"tensor_parallel_size={size} must divide the model's {heads} attention heads and "
                         f"{kv_heads} key/value heads")


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters this rank holds (its shards: a DTensor's local part)."""
    total = 0
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        total += local.numel() * local.element_size()
    return total


def agreed_minimum(value: int) -> int:
    """The smallest of every rank's value (each rank calls it at the same point of its load).
    Used for the KV pool's block count: a GPU rank sizes its budget from its own device, and a
    follower with fewer blocks than rank 0 would refuse a call rank 0 runs."""
    agreed = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=_control_group[0])
    return int(agreed.item())


class MirroredRunner:
    """Rank 0's runner: the local runner, plus each state-changing call sent to the followers
    first. Every other attribute is the local runner's (the engine reads it as before)."""

    def __init__(self, runner: Any, control_group: Any) -> None:
        self.runner = runner
        self.control_group = control_group
        # Called with the GroupBrokenError before it is raised (the engine ends its process).
        self.on_broken: Callable[[GroupBrokenError], None] | None = None
        # Calls may come from the loop's worker thread and from the event loop (release between
        # iterations); a call's broadcast and its local run must not interleave with another's.
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        if name in MIRRORED_CALLS:
            return functools.partial(self._mirrored, name)
        if name in UNSPLIT_CALLS:
            raise AttributeError(f"a tensor-parallel group does not {name}: its ranks hold shards of the weights")
        return getattr(self.runner, name)

    def _mirrored(self, name: str, *args: Any) -> Any:
        with self._lock:
            try:
                dist.broadcast_object_list([(name, args)], src=0, group=self.control_group)
                return getattr(self.runner, name)(*args)
            except Exception as error:
                # A plan reaches here whole and checked (the block manager refuses a bad batch
                # before planning it), so whatever failed (a collective, or anything between two of
                # them), the followers cannot be known to be where rank 0 is: the group is done.
                broken = GroupBrokenError(f"tensor-parallel group broken in {name}: {error}")
                if self.on_broken is not None:
                    self.on_broken(broken)
                raise broken from error

    def stop_followers(self) -> None:
        """Let the followers' `follow` return (a clean shutdown)."""
        with self._lock:
            dist.broadcast_object_list([(_STOP, ())], src=0, group=self.control_group)


class Follower:
    """A follower rank's runner and the loop that keeps it in step with rank 0's."""

    def __init__(self, runner: Any, control_group: Any) -> None:
        self.runner = runner
        self.control_group = control_group

    def follow(self) -> int:
        return follow(self.runner, self.control_group)


def in_group(runner: Any, rank: int, control_group: Any) -> "MirroredRunner | Follower":
    """Rank 0's runner mirrors its calls; any other rank's follows them."""
    return MirroredRunner(runner, control_group) if rank == 0 else Follower(runner, control_group)


def follow(runner: Any, control_group: Any) -> int:
    """A follower's loop: run each planned step rank 0 sends on this rank's pool, computing no
    logits to answer with, until rank 0 stops the group (-> the number of steps run) or a
    collective fails (GroupBrokenError)."""
    calls = 0
    while True:
        message: list[Any] = [None]
        try:
            dist.broadcast_object_list(message, src=0, group=control_group)
        except RuntimeError as error:
            raise GroupBrokenError(f"tensor-parallel group lost rank 0: {error}") from error
        name, args = message[0]
        if name == _STOP:
            return calls
        if name not in MIRRORED_CALLS:
            raise GroupBrokenError(f"rank 0 sent an unknown call {name!r}")
        try:
            runner.run(*args, want_logits=False)
        except Exception as error:
            raise GroupBrokenError(f"tensor-parallel group lost a rank (in {name}): {error}") from error
        calls += 1
