"""Device and host KV block pools, with automatic prefix caching. Moves block ids, never tensors (no torch).

Prefix caching: a full device block whose KV is computed is offered to the cache under a chained hash
of (its parent block's hash, its tokens), so a hash names the whole prefix up to the block's end. A
sequence that starts from scratch takes the longest chain of cached blocks matching its tokens and
computes only the rest. Device blocks are reference-counted: a cached block may sit in many block
tables at once, and is never written again (only full blocks are cached, and a sequence writes only
past its computed tokens). A block whose count drops to zero goes back to the free pool but keeps its
cache entry, most recently used last; allocation takes blocks from the front of the pool, blocks that
hold no cached KV first, then cached ones least recently used first (an eviction).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

from batching.sequence import Sequence

ROOT_HASH = bytes(16)  # the parent of a sequence's first block


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def block_hash(parent: bytes, tokens: list[int], extra: bytes = b"") -> bytes:
    """Names a full block's KV: the hash of everything before it, its tokens, and `extra`: anything else
    that changes its KV (genq feeds token ids only, so nothing yet; extra model inputs would go here).
    A cryptographic hash: token ids come from users, and a collision would hand one request another's KV.
    """
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    h.update(extra)
    return h.digest()


class BlockManager:
    """Owns the pools. A sequence's blocks live in `seq.block_table` / `seq.host_block_table`.

    Every `can_*` check has an act that either happens whole or returns None (never half-happens).
    `free_device` holds every device block that no sequence references, cached or not: all of them can
    be handed out, so "free" counts include cached blocks (they are evicted on demand).
    """

    def __init__(
        self,
        num_device_blocks: int,
        num_host_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
    ):
        self.block_size = block_size
        self.num_device_blocks = num_device_blocks
        self.num_host_blocks = num_host_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.free_device: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_device_blocks))
        self.free_host: deque[int] = deque(range(num_host_blocks))
        # host blocks swapped in during this step: the runner copies them to the device after this
        # step's swap-outs, so they become reusable only at the next step (start_step)
        self.host_released: list[int] = []
        self.ref_counts = [0] * num_device_blocks
        self.hash_of_block: list[bytes | None] = [None] * num_device_blocks
        self.cached: dict[bytes, int] = {}  # block hash -> device block holding that KV
        # counters
        self.num_queried_tokens = 0  # tokens of sequences that started from scratch
        self.num_hit_tokens = 0  # of those, tokens whose KV came from the cache
        self.num_evictions = 0  # cached blocks handed out for other KV

    def start_step(self) -> None:
        """A new step is being scheduled: host blocks read by the last step's swap-ins are free again."""
        self.free_host.extend(self.host_released)
        self.host_released.clear()

    # --- prefix cache -----------------------------------------------------------------------------

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """The device blocks holding the longest cached prefix of `seq`'s tokens (no change to any pool).

        Only for a sequence without KV; at least one token is always left to compute, so the step that
        finishes the prefill has logits to sample from."""
        if not self.enable_prefix_caching or seq.num_computed_tokens or seq.block_table:
            return []
        hit = []
        for h in self._hashes(seq, (seq.num_tokens - 1) // self.block_size):
            block = self.cached.get(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def num_taken_by(self, hit: list[int]) -> int:
        """Free blocks that taking `hit` removes from the pool (the cached blocks nobody references)."""
        return sum(1 for b in hit if self.ref_counts[b] == 0)

    def take_cached_prefix(self, seq: Sequence, hit: list[int]) -> None:
        """Start `seq` on the cached blocks `hit` (from find_cached_prefix; may be empty): its KV for
        their tokens exists. Counts the query for the hit rate."""
        assert not seq.num_computed_tokens and not seq.block_table, f"{seq} already has KV"
        for b in hit:
            self._ref(b)
        seq.block_table = list(hit)
        seq.num_cache_offered_blocks = len(hit)
        seq.num_computed_tokens = len(hit) * self.block_size
        self.num_queried_tokens += seq.num_tokens
        self.num_hit_tokens += seq.num_computed_tokens

    def reset_prefix_cache(self) -> None:
        """Forget every cached block nobody references, and zero the counters."""
        for b in list(self.free_device):
            h = self.hash_of_block[b]
            if h is not None:
                del self.cached[h]
                self.hash_of_block[b] = None
                self.free_device.move_to_end(b, last=False)
        self.num_queried_tokens = self.num_hit_tokens = self.num_evictions = 0

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Offer `seq`'s full, computed device blocks to the cache (a prefix already cached elsewhere
        keeps its first block; this copy stays private and goes when freed)."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if full <= seq.num_cache_offered_blocks:
            return
        hashes = self._hashes(seq, full)
        for i in range(seq.num_cache_offered_blocks, full):
            b, h = seq.block_table[i], hashes[i]
            if self.hash_of_block[b] is None and h not in self.cached:
                self.cached[h] = b
                self.hash_of_block[b] = h
        seq.num_cache_offered_blocks = full

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """`seq.block_hashes`, extended to its first `num_blocks` full blocks."""
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[i - 1] if i else ROOT_HASH
            hashes.append(block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs]))
        return hashes

    # --- device blocks for new tokens -------------------------------------------------------------

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` still needs so that its first `num_computed + num_new_tokens` tokens have slots."""
        need = blocks_for(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, need - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) <= len(self.free_device)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[int] | None:
        """Give `seq` slots for `num_new_tokens` more tokens; None (and no change) if the pool is short."""
        n = self.num_new_blocks(seq, num_new_tokens)
        if n > len(self.free_device):
            return None
        new = [self._take_free_block() for _ in range(n)]
        seq.block_table.extend(new)
        return new

    def max_tokens_allocatable(self, seq: Sequence) -> int:
        """How many more tokens `seq` can get slots for with the blocks free now."""
        capacity = (len(seq.block_table) + len(self.free_device)) * self.block_size
        return max(0, capacity - seq.num_computed_tokens)

    def free(self, seq: Sequence) -> None:
        """Release all of `seq`'s device blocks (its computed full ones stay cached) and host blocks."""
        self.cache_computed_blocks(seq)
        self._release(seq.block_table)
        self.free_host.extend(seq.host_block_table)
        seq.block_table = []
        seq.host_block_table = []
        seq.num_cache_offered_blocks = 0

    def _take_free_block(self) -> int:
        block, _ = self.free_device.popitem(last=False)
        h = self.hash_of_block[block]
        if h is not None:  # cached KV nobody references: evicted for new KV
            del self.cached[h]
            self.hash_of_block[block] = None
            self.num_evictions += 1
        self.ref_counts[block] = 1
        return block

    def _ref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_device[block]
        self.ref_counts[block] += 1

    def _release(self, table: list[int]) -> None:
        """Drop one reference to each block of `table`. Unreferenced cached blocks go to the back of the
        pool (evicted last), the table's tail first so that a prefix outlives its extensions; blocks
        without cached KV go to the front (handed out first)."""
        for b in reversed(table):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_device[b] = None
                if self.hash_of_block[b] is None:
                    self.free_device.move_to_end(b, last=False)

    # --- swapping ---------------------------------------------------------------------------------

    def num_used_blocks(self, seq: Sequence) -> int:
        """Blocks that hold computed KV (the rest of the table, if any, is reserved but empty)."""
        return blocks_for(seq.num_computed_tokens, self.block_size)

    def can_swap_out(self, seq: Sequence) -> bool:
        return self.num_used_blocks(seq) <= len(self.free_host)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]] | None:
        """Copy `seq`'s computed blocks to host blocks of its own and release its device blocks (shared
        ones stay with their other owners, cached ones stay cached); returns (device, host) pairs to
        copy, or None."""
        n = self.num_used_blocks(seq)
        if n > len(self.free_host):
            return None
        self.cache_computed_blocks(seq)
        host = [self.free_host.popleft() for _ in range(n)]
        mapping = list(zip(seq.block_table[:n], host, strict=True))
        self._release(seq.block_table)
        seq.block_table = []
        seq.num_cache_offered_blocks = 0
        seq.host_block_table = host
        return mapping

    def can_swap_in(self, seq: Sequence, extra_blocks: int = 0) -> bool:
        return len(seq.host_block_table) + extra_blocks <= len(self.free_device)

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]] | None:
        """Move `seq`'s host blocks back to device blocks; returns (host, device) pairs to copy, or None."""
        n = len(seq.host_block_table)
        if n > len(self.free_device):
            return None
        device = [self._take_free_block() for _ in range(n)]
        mapping = list(zip(seq.host_block_table, device, strict=True))
        self.host_released.extend(seq.host_block_table)
        seq.host_block_table = []
        seq.block_table = device
        return mapping

    # --- gauges and checks ------------------------------------------------------------------------

    @property
    def num_free_device_blocks(self) -> int:
        return len(self.free_device)

    @property
    def num_free_host_blocks(self) -> int:
        return len(self.free_host) + len(self.host_released)

    @property
    def num_cached_device_blocks(self) -> int:
        return len(self.cached)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def device_usage(self) -> float:
        return 1.0 - len(self.free_device) / self.num_device_blocks

    def host_usage(self) -> float:
        return 1.0 - self.num_free_host_blocks / self.num_host_blocks if self.num_host_blocks else 0.0

    def check_invariants(self, live: list[Sequence]) -> None:
        """Each device block is free (cached or not) or referenced, never both, and its count is the
        number of tables holding it; only full, cached blocks are shared, and a cached block holds the
        KV its table expects; each host block is free or owned once; tables cover the computed tokens."""
        refs = [0] * self.num_device_blocks
        for s in live:
            assert len(set(s.block_table)) == len(s.block_table), f"{s} holds a block twice"
            for b in s.block_table:
                refs[b] += 1
        assert refs == self.ref_counts, "a reference count differs from the tables holding the block"
        free = list(self.free_device)
        assert len(set(free)) == len(free), "a device block is free twice"
        assert sorted(free) == [b for b in range(self.num_device_blocks) if refs[b] == 0], (
            "device block leaked, or both free and owned"
        )
        assert all(self.hash_of_block[b] == h for h, b in self.cached.items()), "cache index corrupt"
        assert sum(h is not None for h in self.hash_of_block) == len(self.cached), "cache index corrupt"
        for b in range(self.num_device_blocks):
            assert refs[b] <= 1 or self.hash_of_block[b] is not None, f"block {b} shared but not cached"
        host_owned = [b for s in live for b in s.host_block_table]
        all_host = host_owned + list(self.free_host) + self.host_released
        assert sorted(all_host) == list(range(self.num_host_blocks)), "host block leaked or double-owned"
        for s in live:
            assert not (s.block_table and s.host_block_table), f"{s} holds device and host blocks at once"
            table = s.host_block_table or s.block_table
            assert len(table) * self.block_size >= s.num_computed_tokens, f"{s} lacks blocks for its KV"
            full = min(s.num_computed_tokens // self.block_size, len(s.block_table))
            parent, bs = ROOT_HASH, self.block_size
            for i, b in enumerate(s.block_table[:full]):  # hashed afresh from the tokens, not the memo
                parent = block_hash(parent, s.token_ids[i * bs : (i + 1) * bs])
                h = self.hash_of_block[b]
                assert h is None or h == parent, f"{s} block {i} holds another prefix's KV"
