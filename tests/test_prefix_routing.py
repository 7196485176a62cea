"""policies.prefix_routing: prompts sharing their first blocks rank the target replicas alike in
every router (rendezvous hashing), load breaks the tie, and keys spread over the replicas."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

from specserve.policies.prefix_routing import IMBALANCE_SEQUENCES, prefix_key, rank_replicas

REPLICAS = ["r-a", "r-b", "r-c", "r-d"]
SYSTEM = list(range(100, 164))   # 64 tokens: the key's 4 blocks


def test_the_key_covers_the_first_full_blocks_only():
    assert prefix_key(list(range(15))) is None                     # not one full block
    assert prefix_key(SYSTEM + [1, 2, 3]) == prefix_key(SYSTEM + [9, 9])
    assert prefix_key(SYSTEM) != prefix_key([7] + SYSTEM[1:])
    assert prefix_key(list(range(40))) == prefix_key(list(range(32)) + [0])   # two full blocks of 16
    # A digest, not Python's per-process hash: another interpreter computes the same key.
    other = subprocess.run([sys.executable, "-c", "from specserve.policies.prefix_routing import prefix_key;"
                            f"print(prefix_key({SYSTEM!r}))"], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == prefix_key(SYSTEM)


def test_every_router_ranks_the_replicas_alike_and_a_replica_leaving_moves_only_its_keys():
    key = prefix_key(SYSTEM)
    first = rank_replicas(REPLICAS, key, {})
    assert rank_replicas(list(reversed(REPLICAS)), key, {}) == first
    keys = [prefix_key([k] * 16) for k in range(400)]
    before = {key: rank_replicas(REPLICAS, key, {})[0] for key in keys}
    after = {key: rank_replicas(REPLICAS[1:], key, {})[0] for key in keys}
    assert all(after[key] == before[key] for key in keys if before[key] != REPLICAS[0])
    shares = Counter(before.values())
    assert all(60 <= shares[replica] <= 140 for replica in REPLICAS), shares   # ~100 each


def test_load_breaks_the_tie_only_past_the_imbalance():
    key = prefix_key(SYSTEM)
    preferred = rank_replicas(REPLICAS, key, {})[0]
    slightly_busy = {preferred: IMBALANCE_SEQUENCES}
    assert rank_replicas(REPLICAS, key, slightly_busy)[0] == preferred
    overloaded = {preferred: IMBALANCE_SEQUENCES + 1}
    ranked = rank_replicas(REPLICAS, key, overloaded)
    assert ranked[0] != preferred and ranked[-1] == preferred
    assert rank_replicas(REPLICAS, None, {"r-a": 3, "r-b": 1, "r-c": 2, "r-d": 5}) == ["r-b", "r-c", "r-a", "r-d"]
    assert rank_replicas([], key, {}) == []
