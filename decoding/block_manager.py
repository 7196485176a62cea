"""Where an engine's KV blocks live: which blocks each sequence's tokens are in, per KV cache group,
and which full blocks any later sequence may share (prefix caching). nano-vllm's `BlockManager` and
vLLM v1's `KVCacheManager` in one small piece, Ray-free and model-free.

The scheduler owns it (decoding.scheduler): `plan` turns a batch of engine calls (each names a
sequence and its WHOLE history) into a `StepPlan`, the fully planned forward the runner runs
(decoding.batched_runner: per row the tokens to run, where they start, every group's block table,
the copy-on-write copies to make first). After the forward, `commit` records what the blocks now
hold; a forward that failed is undone by `abort`. The runner never allocates, and the planner never
asks the runner what it holds.

Per call, `plan` reuses the longest prefix of the history the sequence's own table holds (cropping
the rest: that is the rollback), extends it with cached full blocks other sequences computed (a
block's key chains its tokens to every token before it, `block_key`), and takes new blocks for the
rest. A block several tables hold is never written: a call writing into it gets a copy first
(the speculation cache's forks share their parent's blocks, `fork`). Sliding-window groups let go
of the blocks wholly older than their window after each forward (`_let_go_outside_windows`), so
their memory is bounded by the window (docs/kv-memory.md).

`BlockAllocator` hands out block ids and keeps freed keyed blocks findable in LRU order; the
memory behind an id is the runner's (decoding.paged_cache.PagedKVCache), which grows its pools to
the plan's `pool_blocks` on CPU, so an idle engine holds little memory.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from specserve.decoding.errors import NoFreeBlocksError, NoFreeSlotError, SequenceStateError
from specserve.decoding.paged_cache import NO_BLOCK, KVGroup, blocks_before_window, blocks_for

FIRST_GROWTH_BLOCKS = 64  # blocks the pool starts with on first use (then grows by half again)

BlockKey = tuple[int, tuple[int, ...]]  # (the previous block's hash, this block's tokens)


def block_key(parent_hash: int, tokens: Sequence[int]) -> BlockKey:
    """What identifies a full block's keys and values: its tokens and, through the parent's hash,
    every token before them (and the cache salt at the chain's root). hash(key) is the next
    block's parent hash. The key itself, not only its hash, is what the cache is looked up by,
    so a hash collision can never hand out another prefix's keys."""
    return parent_hash, tuple(tokens)


def salt_hash(salt: str) -> int:
    """Root of every hash chain: whatever changes the keys and values besides the tokens (the
    model and its weights' version), so a block computed by other weights is never found."""
    return hash(("specserve-prefix-cache", salt))


@dataclass
class ForwardCall:
    """One sequence's share of a batched forward, at the engine's level: make seq_id's cache hold
    exactly token_ids (its whole history) and return logits for the last num_rows positions."""

    seq_id: str
    token_ids: Sequence[int]
    num_rows: int = 1
    # Its rows may be scored over a draft's token map (decoding.token_map): drawn by argmax, or never read.
    over_map: bool = False


@dataclass(frozen=True)
class StepPlan:
    """One forward, fully planned: all a runner needs, nothing it must look up (plain data, so a
    tensor-parallel group sends it to its followers as it is)."""

    seq_ids: tuple[str, ...]
    input_ids: tuple[tuple[int, ...], ...]   # per row: the tokens to run (positions start, start + 1, ...)
    starts: tuple[int, ...]                   # per row: tokens its tables already hold before them
    num_rows: tuple[int, ...]                 # per row: logits wanted for its last num_rows tokens
    # [group][row]: the row's block table in KV cache group g, covering start + len(input_ids)
    group_tables: tuple[tuple[tuple[int, ...], ...], ...]
    copies: tuple[tuple[int, int], ...] = ()   # copy-on-write: (source, destination) blocks, before the forward
    pool_blocks: int = 0                       # block ids the pools must have room for
    over_map: bool = False                     # every row's call may be scored over a token map

    @property
    def num_new_tokens(self) -> int:
        """Tokens the forward computes (the engines' cost samples)."""
        return sum(len(ids) for ids in self.input_ids)


class BlockAllocator:
    """Block ids with reference counts and prefix-cache keys (nano-vllm's BlockManager idea).

    A block has a reference count (the tables that hold it) and, once a sequence has filled it, a
    key (block_key) by which `find` hands it to any later sequence with the same prefix. A block
    nobody references but that still has a key stays findable, in LRU order, and is evicted (its
    key dropped) only when `allocate` finds no never-keyed free block and the pool cannot grow. So
    `num_free` counts those cached blocks as free: they are memory on loan.

    `capacity` is how many ids the pools have room for so far: it grows by half again up to
    num_blocks as blocks are needed (preallocated: all of them from the start, as on CUDA)."""

    def __init__(self, num_blocks: int, preallocated: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"need num_blocks >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.capacity = 0
        self._free: list[int] = []   # min-heap of unreferenced blocks without a key
        self._cached: OrderedDict[int, None] = OrderedDict()   # unreferenced keyed blocks, least recent first
        self._refs: dict[int, int] = {}            # referenced blocks -> how many tables hold them
        self._key_of: dict[int, BlockKey] = {}     # keyed blocks (referenced or cached) -> their key
        self._block_of: dict[BlockKey, int] = {}   # ... and back
        if preallocated:
            self._grow(num_blocks)

    @property
    def num_free(self) -> int:
        """Blocks that can still be handed out: never-keyed free ones, cached ones nobody
        references (evicted on demand), and those the pools have not grown to yet."""
        return len(self._free) + len(self._cached) + self.num_blocks - self.capacity

    @property
    def num_used(self) -> int:
        """Blocks some sequence references."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks still findable by their key (counted in num_free)."""
        return len(self._cached)

    def allocate(self, count: int) -> list[int]:
        """count blocks, each referenced once: never-keyed free blocks first (lowest ids), then
        new room in the pool, then the least recently used cached blocks (their keys dropped).
        NoFreeBlocksError, taking none, if fewer are free."""
        if count > self.num_free:
            raise NoFreeBlocksError(f"need {count} KV blocks, {self.num_free} of {self.num_blocks} are free; "
                                    "wait for sequences to finish")
        short = count - len(self._free)
        if short > 0 and self.capacity < self.num_blocks:
            want = max(short + self.capacity, self.capacity * 3 // 2, FIRST_GROWTH_BLOCKS)
            self._grow(min(self.num_blocks, want) - self.capacity)
        while len(self._free) < count:   # evict: the pool is at its budget
            block, _ = self._cached.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
            heapq.heappush(self._free, block)
        blocks = [heapq.heappop(self._free) for _ in range(count)]
        for block in blocks:
            self._refs[block] = 1
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block. A block nobody references any more stays findable
        if it has a key (most recently freed last in the eviction order: free a table's blocks
        tail first, so a shared prefix outlives the tails), else it is simply free."""
        for block in blocks:
            refs = self._refs[block] - 1
            if refs:
                self._refs[block] = refs
                continue
            del self._refs[block]
            if block in self._key_of:
                self._cached[block] = None
            else:
                heapq.heappush(self._free, block)

    def find(self, key: BlockKey) -> int | None:
        """The block holding key's tokens' keys and values, or None."""
        return self._block_of.get(key)

    def share(self, block: int) -> None:
        """One more reference to a found block (taken out of the eviction order if it was cached)."""
        if block in self._refs:
            self._refs[block] += 1
        else:
            del self._cached[block]
            self._refs[block] = 1

    def refs(self, block: int) -> int:
        return self._refs.get(block, 0)

    def publish(self, block: int, key: BlockKey) -> None:
        """Make a referenced block, just filled with key's tokens, findable. A key already held by
        another block (two sequences computed the same block at once) keeps that block; this one
        stays private."""
        if key not in self._block_of and block not in self._key_of:
            self._block_of[key] = block
            self._key_of[block] = key

    def unpublish(self, block: int) -> None:
        """Its one owner is about to overwrite part of the block (a rollback into it): it is no
        longer what its key says."""
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._block_of[key]

    def _grow(self, num_blocks: int) -> None:
        for block in range(self.capacity, self.capacity + num_blocks):
            heapq.heappush(self._free, block)
        self.capacity += num_blocks


@dataclass
class _Sequence:
    # Its block table per KV cache group: token i lives in tables[g][i // block_size]; in a
    # windowed group, a leading run of NO_BLOCK for the blocks it let go of (outside its window).
    tables: list[list[int]]
    token_ids: list[int]  # exactly the tokens whose keys/values the blocks hold (after a commit)
    # With prefix caching: the chained hash of each full block of token_ids (block_key).
    hashes: list[int] = field(default_factory=list)
    cached_tokens: int = 0   # tokens it has found in the prefix cache (at admission, or a later chunk's)
    root: int = 0            # the parent of its first block's key (`BlockManager._root`)


@dataclass
class _Reuse:
    """How one call of a batch starts: from `start` tokens already in its table, after sharing
    `hits` (cached blocks found for the tokens after what it held)."""

    start: int
    hits: list[tuple[tuple[int, ...], int]]   # (the block of every group, their chained hash), in table order
    new: bool                     # the plan admits the sequence with this call
    looked_up: int = 0            # tokens it looked for in the prefix cache (from its first not fully held block)


@dataclass
class _Pending:
    """What `commit` or `abort` needs of a plan the runner is running."""

    entries: list[_Sequence]
    histories: list[list[int]]
    new_seq_ids: list[str]
    copied: list[bool]   # the row's last block is a copy-on-write copy made by the runner


class BlockManager:
    """Every sequence's block tables, the prefix cache and the sequence slots of one engine."""

    def __init__(self, num_blocks: int, block_size: int, groups: Sequence[KVGroup], max_sequences: int,
                 max_context: int, rollback_tokens: int = 0, prefix_caching: bool = True, cache_salt: str = "",
                 preallocated: bool = False) -> None:
        """groups: the runner's KV cache groups (decoding.paged_cache.kv_groups); max_context: the
        longest history served; rollback_tokens: how far back from its end a later call may crop a
        sequence and still find its sliding-window layers' keys (deeper, it recomputes);
        cache_salt: what besides the tokens decides the keys and values (the model and its weights'
        version), the root of every block's hash chain; preallocated: the pools hold every block
        from the start (CUDA)."""
        if max_sequences < 1:
            raise ValueError(f"max_sequences must be >= 1, got {max_sequences}")
        self.allocator = BlockAllocator(num_blocks, preallocated)
        self.block_size = block_size
        self.num_groups = len(groups)
        self.max_sequences = max_sequences
        self.max_context = max_context
        self.rollback_tokens = rollback_tokens
        # (index, window) of the windowed KV cache groups: none for a model without windows.
        self._windows = [(index, group.window) for index, group in enumerate(groups) if group.window is not None]
        self.prefix_caching = prefix_caching
        self._salt = salt_hash(cache_salt)
        self._sequences: dict[str, _Sequence] = {}
        self._tenant_salts: dict[str, str] = {}   # seq_id -> its request's cache_salt (`salt_sequence`)
        self._pending: dict[int, _Pending] = {}
        # vLLM's counters: tokens calls looked for in the prefix cache (all a new sequence's but the
        # rows it asks for; a held one's past what it holds, when it recomputes any), and found there.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @classmethod
    def for_runner(cls, runner) -> "BlockManager":
        """The block manager of a runner's pool (decoding.batched_runner: its capacity, groups,
        context and cache settings)."""
        return cls(runner.kv_capacity.num_blocks, runner.block_size, runner.cache.groups, runner.max_sequences,
                   runner.max_context, runner.rollback_tokens, runner.prefix_caching, runner.cache_salt,
                   preallocated=runner.cache.capacity >= runner.kv_capacity.num_blocks)

    # Planning a forward

    def plan(self, calls: Sequence[ForwardCall]) -> StepPlan:
        """The forward that makes each call's sequence hold its history: blocks reused, shared
        from the prefix cache, copied where shared and written, or newly taken. The whole batch is
        checked before anything changes: ValueError on a repeated seq_id, SequenceStateError on a
        bad call, NoFreeSlotError when the new seq_ids do not fit, NoFreeBlocksError (admitting
        nothing, taking no block) when the pool cannot cover them. Then `commit` once the runner
        ran it, or `abort` if it failed."""
        if not calls:
            raise ValueError("a step plans at least one call")
        histories = self._checked_batch(calls)
        held = [self._sequences.get(call.seq_id) for call in calls]
        reuses = [self._reuse(history, call.num_rows, entry, self._root(call.seq_id))
                  for call, history, entry in zip(calls, histories, held)]
        entries, copies = self._take_blocks(calls, histories, held, reuses)
        starts = [reuse.start for reuse in reuses]
        plan = StepPlan(
            seq_ids=tuple(call.seq_id for call in calls),
            input_ids=tuple(tuple(history[start:]) for history, start in zip(histories, starts)),
            starts=tuple(starts), num_rows=tuple(call.num_rows for call in calls),
            group_tables=tuple(tuple(tuple(entry.tables[g]) for entry in entries) for g in range(self.num_groups)),
            copies=tuple(pair for row in copies for pair in row), pool_blocks=self.allocator.capacity,
            over_map=all(call.over_map for call in calls))
        self._pending[id(plan)] = _Pending(entries, histories, [call.seq_id for call, reuse in zip(calls, reuses)
                                                                if reuse.new], [bool(row) for row in copies])
        return plan

    def commit(self, plan: StepPlan) -> None:
        """The runner ran plan: each sequence holds its history; the blocks it filled become
        findable, and windowed groups let go of what their window no longer sees."""
        pending = self._pending.pop(id(plan))
        for entry, history in zip(pending.entries, pending.histories):
            entry.token_ids = history
            if self.prefix_caching:
                self._publish_full_blocks(entry)
            self._let_go_outside_windows(entry)

    def abort(self, plan: StepPlan) -> None:
        """The runner did not run plan (it raised): tokens past a sequence's reused prefix were
        never read, so a held sequence stays valid cropped back to it (to its last full block where
        a copy-on-write copy may not have been made); the sequences plan admitted are let go."""
        pending = self._pending.pop(id(plan))
        for entry, start, copied in zip(pending.entries, plan.starts, pending.copied):
            self._crop(entry, start // self.block_size * self.block_size if copied else start)
        for seq_id in pending.new_seq_ids:
            self.release(seq_id)

    def _checked_batch(self, calls: Sequence[ForwardCall]) -> list[list[int]]:
        """Every call's history, after checking the whole batch up front (distinct ids, valid
        calls, slots for the new sequences), so a bad batch changes no state."""
        seq_ids = [call.seq_id for call in calls]
        if len(set(seq_ids)) != len(seq_ids):
            duplicated = sorted({seq_id for seq_id in seq_ids if seq_ids.count(seq_id) > 1})
            raise ValueError(f"a batch must name each sequence once; repeated: {duplicated}")
        histories = [checked_history(call, self.max_context) for call in calls]
        num_new = sum(seq_id not in self._sequences for seq_id in seq_ids)
        if num_new > self.num_free_slots:
            raise NoFreeSlotError(f"cannot hold {num_new} new sequence(s): already holding "
                                  f"{len(self._sequences)} of max_sequences={self.max_sequences}; release "
                                  "finished sequences first")
        return histories

    def _reuse(self, history: list[int], num_rows: int, entry: _Sequence | None, root: int) -> _Reuse:
        """Where a call starts: the longest prefix of history its own table holds (cropping the
        rest: a rollback), extended by cached blocks that hold the next full blocks of history.
        Only the crop changes state (as a rollback, it is valid whatever follows); num_rows
        positions are always recomputed."""
        limit = len(history) - num_rows
        held, hits = self._reusable(history, limit, entry, root)
        if entry is not None:
            self._crop(entry, held)
        aligned = held // self.block_size * self.block_size
        looked_up = limit - aligned if self.prefix_caching and held < limit else 0
        if not hits:
            return _Reuse(held, [], entry is None, looked_up)
        if entry is not None:
            self._crop(entry, aligned)   # its partly valid last block gives way to a cached full one
        return _Reuse(aligned + len(hits) * self.block_size, hits, entry is None, looked_up)

    def _reusable(self, history: list[int], limit: int, entry: _Sequence | None, root: int
                  ) -> tuple[int, list[tuple[tuple[int, ...], int]]]:
        """(tokens of history's first limit that entry holds and a call can start from, the cached
        blocks extending them from the last full block they fill: none when there are none, or when
        a windowed group could not start there). Changes nothing: `_reuse` takes it, and the
        scheduler plans from it (`cached_prefix_length`)."""
        held = 0 if entry is None else self._servable(entry, common_prefix_length(entry.token_ids, history, limit))
        hits = self._cached_blocks(history, held, limit, [] if entry is None else entry.hashes, root)
        aligned = held // self.block_size * self.block_size
        if hits and entry is not None and self._servable(entry, aligned) < aligned:
            return held, []
        return held, hits

    def _cached_blocks(self, history: list[int], held: int, limit: int, hashes: list[int], root: int
                       ) -> list[tuple[tuple[int, ...], int]]:
        """(every group's block, chained hash) of the cached blocks holding history's full blocks
        after the first held tokens, up to the first one some group has not cached, within the first
        limit tokens (hashes: those of the held full blocks; root: the first block's parent). A
        windowed group must still have the block too, even one outside the window of the hit's end
        (it is let go again after the forward): the simplest rule that is right, at the cost of
        hits vLLM's would find."""
        if not self.prefix_caching:
            return []
        size = self.block_size
        first = held // size
        parent = hashes[first - 1] if first else root
        hits = []
        for index in range(first, limit // size):
            key = block_key(parent, history[index * size:(index + 1) * size])
            blocks = tuple(self.allocator.find((group, key)) for group in range(self.num_groups))
            if None in blocks:
                break
            parent = hash(key)
            hits.append((blocks, parent))
        return hits

    def _take_blocks(self, calls: Sequence[ForwardCall], histories: list[list[int]],
                     held: list[_Sequence | None], reuses: list[_Reuse]
                     ) -> tuple[list[_Sequence], list[list[tuple[int, int]]]]:
        """Every call's table made to cover its history: cached blocks shared, a shared or
        published last block the call writes into copied or unpublished, new blocks allocated;
        -> the entries and each row's copy-on-write copies. NoFreeBlocksError, admitting nothing
        and taking no block, when the pool cannot cover them."""
        size, allocator = self.block_size, self.allocator
        writes_into_last = [reuse.start % size != 0 for reuse in reuses]   # then it is held and hit nothing
        shares = Counter(block for reuse in reuses for blocks, _ in reuse.hits for block in blocks)
        copies = sum(allocator.refs(table[-1]) + shares[table[-1]] > 1
                     for entry, partial in zip(held, writes_into_last) if partial for table in entry.tables)
        needed = copies + sum(self.num_groups * (blocks_for(len(history), size) - len(reuse.hits))
                              - (0 if entry is None else sum(len(table) for table in entry.tables))
                              for history, entry, reuse in zip(histories, held, reuses))
        revived = len({block for reuse in reuses for blocks, _ in reuse.hits for block in blocks
                       if allocator.refs(block) == 0})
        if needed + revived > allocator.num_free:
            raise NoFreeBlocksError(f"this batch needs {needed + revived} more KV blocks, {allocator.num_free} of "
                                    f"{allocator.num_blocks} are free; wait for sequences to finish")
        entries = []
        for call, history, entry, reuse in zip(calls, histories, held, reuses):
            if entry is None:
                entry = self._sequences[call.seq_id] = _Sequence([[] for _ in range(self.num_groups)], [],
                                                                 root=self._root(call.seq_id))
            entry.cached_tokens += len(reuse.hits) * size
            self.prefix_cache_queries += reuse.looked_up
            self.prefix_cache_hits += len(reuse.hits) * size
            for blocks, block_hash in reuse.hits:
                for table, block in zip(entry.tables, blocks):
                    allocator.share(block)
                    table.append(block)
                entry.hashes.append(block_hash)
            if reuse.hits:
                entry.token_ids = history[:reuse.start]
            entries.append(entry)
        # After every share: a block another call of this batch just shared must be copied too.
        row_copies = [self._make_last_block_writable(entry) if partial else []
                      for entry, partial in zip(entries, writes_into_last)]
        for entry, history in zip(entries, histories):
            for table in entry.tables:
                table.extend(allocator.allocate(blocks_for(len(history), size) - len(table)))
        return entries, row_copies

    def _make_last_block_writable(self, entry: _Sequence) -> list[tuple[int, int]]:
        """The call writes into its tables' last blocks after their first tokens: a block other
        tables hold gets a copy in its place (copy-on-write; -> the (source, copy) pairs the
        runner copies before the forward; the source stays referenced by the others meanwhile),
        a block only it holds stops being findable (its key no longer says what it holds)."""
        copies = []
        for table in entry.tables:
            block = table[-1]
            if self.allocator.refs(block) > 1:
                copy = self.allocator.allocate(1)[0]
                self.allocator.free([block])
                table[-1] = copy
                copies.append((block, copy))
            else:
                self.allocator.unpublish(block)
        return copies

    def _publish_full_blocks(self, entry: _Sequence) -> None:
        """Make the blocks entry has just filled findable by their chained keys."""
        size, tokens = self.block_size, entry.token_ids
        parent = entry.hashes[-1] if entry.hashes else entry.root
        for index in range(len(entry.hashes), len(tokens) // size):
            key = block_key(parent, tokens[index * size:(index + 1) * size])
            for group, table in enumerate(entry.tables):
                self.allocator.publish(table[index], (group, key))
            parent = hash(key)
            entry.hashes.append(parent)

    def _crop(self, entry: _Sequence, length: int) -> int:
        """Keep the first length tokens and the blocks they need; the rest are let go (tail first).
        Nothing is kept when a windowed group no longer holds what a query at position length sees
        (`_servable`). -> the tokens kept."""
        length = self._servable(entry, length)
        if length < len(entry.token_ids):
            del entry.token_ids[length:]
        del entry.hashes[length // self.block_size:]
        keep = blocks_for(length, self.block_size)
        for table in entry.tables:
            if keep < len(table):
                self.allocator.free([block for block in table[keep:][::-1] if block != NO_BLOCK])
                del table[keep:]
        return length

    def _servable(self, entry: _Sequence, length: int) -> int:
        """length, if a call starting there finds every key its queries see: in each windowed
        group, those from length - window + 1 on; else 0 (a crop deeper than rollback_tokens
        behind the end it last held: the call recomputes, from the prefix cache where it can)."""
        for index, window in self._windows:
            table = entry.tables[index]
            if table and table[0] == NO_BLOCK and length - window + 1 < first_held(table) * self.block_size:
                return 0
        return length

    def _let_go_outside_windows(self, entry: _Sequence) -> None:
        """Free each windowed group's blocks wholly older than the keys a query rollback_tokens
        behind the sequence's end sees (paged_cache.blocks_before_window), leaving NO_BLOCK in
        their place: what bounds a windowed group's memory by its window (window_blocks). A later
        call starting at most rollback_tokens back (a rejected speculative tail) still finds every
        key its queries see; a deeper crop recomputes (`_servable`)."""
        for index, window in self._windows:
            table = entry.tables[index]
            outside = blocks_before_window(len(entry.token_ids), window, self.rollback_tokens, self.block_size)
            held_from = first_held(table)
            if outside > held_from:
                self.allocator.free(table[held_from:outside][::-1])
                table[held_from:outside] = [NO_BLOCK] * (outside - held_from)

    # Sequences

    def salt_sequence(self, seq_id: str, cache_salt: str | None) -> None:
        """seq_id's blocks are keyed under its request's cache_salt (vLLM's per-request salt): from
        its next admission on, it finds only blocks computed under the same salt, and the blocks it
        fills are found only by those (tenant isolation: no request learns from a cache hit what
        another tenant's prompts held). None: the engine's shared cache. The salt outlives the
        sequence's KV (a preempted sequence is admitted again under it) until `forget`."""
        if cache_salt is None:
            self._tenant_salts.pop(seq_id, None)
        else:
            self._tenant_salts[seq_id] = cache_salt

    def _root(self, seq_id: str) -> int:
        """The parent of seq_id's first block's key: the engine's salt (its model and weights), mixed
        with its request's cache_salt where it has one."""
        tenant = self._tenant_salts.get(seq_id)
        return self._salt if tenant is None else hash((self._salt, tenant))

    def forget(self, seq_id: str) -> None:
        """`release`, and seq_id's cache_salt with it: its request is gone from this engine."""
        self.release(seq_id)
        self._tenant_salts.pop(seq_id, None)

    def release(self, seq_id: str) -> None:
        """Let go of seq_id's KV (idempotent): its blocks, of which the full ones stay cached; its
        cache_salt stays (`forget`)."""
        entry = self._sequences.pop(seq_id, None)
        if entry is not None:
            for table in entry.tables:
                self.allocator.free([block for block in table[::-1] if block != NO_BLOCK])

    def rollback(self, seq_id: str, length: int) -> None:
        """Crop seq_id's cache to its first `length` tokens."""
        if length < 0:
            raise ValueError(f"rollback length must be >= 0, got {length}")
        entry = self._sequences.get(seq_id)
        if entry is None:
            raise SequenceStateError(f"unknown sequence {seq_id!r}")
        self._crop(entry, length)

    def fork(self, parent_id: str, child_id: str) -> None:
        """child_id starts holding what parent_id holds, sharing its blocks (the speculation
        cache's branches, decoding.speculation_cache): its first call crops to the history it
        shares, and a write into a shared block copies it first (`_make_last_block_writable`), so
        neither sequence ever sees the other's tokens. Nothing happens if parent_id holds nothing."""
        parent = self._sequences.get(parent_id)
        if parent is None or child_id == parent_id:
            return
        self.release(child_id)
        for table in parent.tables:
            for block in table:
                if block != NO_BLOCK:
                    self.allocator.share(block)
        self._sequences[child_id] = _Sequence([list(table) for table in parent.tables], list(parent.token_ids),
                                              list(parent.hashes), root=parent.root)
        if parent_id in self._tenant_salts:
            self._tenant_salts[child_id] = self._tenant_salts[parent_id]

    def adopt(self, seq_id: str, branch_id: str) -> None:
        """seq_id takes over branch_id's KV (the branch whose block was used), letting go of its
        own; branch_id is forgotten. If branch_id holds nothing, seq_id keeps what it holds."""
        self._tenant_salts.pop(branch_id, None)
        branch = self._sequences.pop(branch_id, None)
        if branch is None:
            return
        self.release(seq_id)
        self._sequences[seq_id] = branch

    def reset(self, cache_salt: str) -> None:
        """Every sequence let go and no cached block findable any more (the chain's root is the
        new cache_salt): the keys and values now belong to other weights (a hot swap)."""
        for seq_id in list(self._sequences):
            self.release(seq_id)
        self._salt = salt_hash(cache_salt)

    # What the scheduler plans from, and the engine reports

    def num_cached(self, seq_id: str) -> int:
        """Tokens of seq_id held in the KV cache (0 if unknown)."""
        entry = self._sequences.get(seq_id)
        return 0 if entry is None else len(entry.token_ids)

    def active_sequences(self) -> list[str]:
        """Ids of the sequences whose KV caches are held, oldest admitted first."""
        return list(self._sequences)

    @property
    def num_free_slots(self) -> int:
        """How many NEW sequences can still be admitted before NoFreeSlotError."""
        return self.max_sequences - len(self._sequences)

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def cached_prefix_length(self, seq_id: str, token_ids: Sequence[int], num_rows: int = 1) -> int:
        """Tokens of token_ids a call would not compute now: what seq_id holds of them, extended
        by the prefix cache (what the scheduler plans a new sequence's prefill from)."""
        history = list(token_ids)
        held, hits = self._reusable(history, len(history) - num_rows, self._sequences.get(seq_id), self._root(seq_id))
        return held // self.block_size * self.block_size + len(hits) * self.block_size if hits else held

    def prefix_cached_tokens(self, seq_id: str) -> int:
        """Tokens seq_id has found in the prefix cache (OpenAI's cached_tokens, read after its
        prefill): at admission, and when a later chunk of its prefill found blocks that another
        sequence finished meanwhile."""
        entry = self._sequences.get(seq_id)
        return 0 if entry is None else entry.cached_tokens

    def table(self, seq_id: str, group: int) -> list[int]:
        """seq_id's block table in KV cache group `group` (KeyError when it holds none)."""
        return list(self._sequences[seq_id].tables[group])

    def blocks_held(self, seq_id: str, group: int | None = None) -> int:
        """Blocks seq_id's tables hold: in every KV cache group, or in group (the groups' index)."""
        entry = self._sequences.get(seq_id)
        if entry is None:
            return 0
        tables = entry.tables if group is None else [entry.tables[group]]
        return sum(len(table) - first_held(table) for table in tables)

    def usage(self) -> dict[str, int]:
        """KV blocks used, free (cached ones among them), tokens held and the prefix cache's
        counters: for engine stats and metrics."""
        allocator = self.allocator
        return {"kv_blocks_used": allocator.num_used, "kv_blocks_free": allocator.num_free,
                "kv_blocks_cached": allocator.num_cached,
                "prefix_cache_queries": self.prefix_cache_queries, "prefix_cache_hits": self.prefix_cache_hits,
                "kv_block_size": self.block_size,
                "kv_tokens_held": sum(len(entry.token_ids) for entry in self._sequences.values())}


def checked_history(call: ForwardCall, max_context: int) -> list[int]:
    """call.token_ids as a list, or SequenceStateError if the protocol cannot serve it."""
    wanted = list(call.token_ids)
    length = len(wanted)
    if not 1 <= call.num_rows <= length:
        raise SequenceStateError(f"sequence {call.seq_id!r}: num_rows={call.num_rows} must be between 1 "
                                 f"and the history length {length}")
    if length > max_context:
        raise SequenceStateError(f"sequence {call.seq_id!r}: {length} tokens exceed the model's context of "
                                 f"{max_context}")
    return wanted


def common_prefix_length(cached: list[int], wanted: list[int], limit: int) -> int:
    """Length of the longest common prefix of cached and wanted, at most limit."""
    limit = min(limit, len(cached), len(wanted))
    # Hot path: the cache is a prefix of the request (one C-level list comparison).
    if cached[:limit] == wanted[:limit]:
        return limit
    for i in range(limit):
        if cached[i] != wanted[i]:
            return i
    return limit


def first_held(table: list[int]) -> int:
    """Index of a table's first block that is not NO_BLOCK (a windowed group lets go of a
    leading run; binary search: a table may have thousands of entries)."""
    low, high = 0, len(table)
    while low < high:
        middle = (low + high) // 2
        if table[middle] == NO_BLOCK:
            low = middle + 1
        else:
            high = middle
    return low
