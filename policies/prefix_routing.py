"""Which target replica a request goes to: the one likely to hold its prompt's prefix in its KV cache.

Each target engine has its own prefix cache (decoding.batched_runner), and a request's target
replica is picked once, at its start. Picked by load alone, a repeated system prompt or a chat's
earlier turns would find their blocks on 1 of N replicas. So requests whose prompts share their
first blocks are sent to the same replica: rendezvous hashing (highest random weight) of a key over
the prompt's first PREFIX_BLOCKS full blocks ranks the replicas the same way in every router, and a
replica that joins or leaves moves only the keys it wins or held. Load breaks the tie: when the
preferred replica holds more than `imbalance` sequences beyond the least loaded one, the least
loaded goes first instead (a hot prefix must not pin a replica while others idle). Prompts shorter
than one block have no key and go by load alone.

Compared with Ray Serve LLM's PrefixCacheAffinityRouter (docs/kv-memory.md): it matches prompt
*text* against a prefix tree of what each replica saw; this keys on the token ids the engines hash
their blocks by, without a shared tree actor, at the price of matching only the first blocks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

PREFIX_BLOCKS = 4          # full blocks of the prompt the key covers
PREFIX_BLOCK_SIZE = 16     # tokens per block (the engines' default KV block)
IMBALANCE_SEQUENCES = 8    # the preferred replica may hold this many sequences more than the least loaded


def prefix_key(token_ids: Sequence[int], block_size: int = PREFIX_BLOCK_SIZE,
               blocks: int = PREFIX_BLOCKS) -> str | None:
    """The affinity key of a prompt: a digest of its first `blocks` full blocks (as many as it
    has), or None when it has not one full block. Stable across processes (not Python's hash)."""
    num_tokens = min(len(token_ids) // block_size, blocks) * block_size
    if num_tokens == 0:
        return None
    data = b"".join(int(token).to_bytes(4, "little", signed=False) for token in token_ids[:num_tokens])
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def _weight(key: str, replica: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}|{replica}".encode(), digest_size=8).digest(), "little")


def rank_replicas(replicas: Sequence[str], key: str | None, load: Mapping[str, float],
                  imbalance: float = IMBALANCE_SEQUENCES) -> list[str]:
    """Replicas in the order to try them for a request with this key: by rendezvous weight (the
    same order in every router), unless the first holds more than `imbalance` sequences beyond the
    least loaded, then by load; by load (the key's order among equals) without a key. load: a
    replica's sequences held; a replica that has not reported counts as empty."""
    if not replicas:
        return []
    by_load = sorted(replicas, key=lambda replica: load.get(replica, 0.0))
    if key is None:
        return by_load
    by_weight = sorted(replicas, key=lambda replica: _weight(key, replica), reverse=True)
    least = load.get(by_load[0], 0.0)
    if load.get(by_weight[0], 0.0) - least > imbalance:
        return sorted(replicas, key=lambda replica: (load.get(replica, 0.0), -_weight(key, replica)))
    return by_weight
