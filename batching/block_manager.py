"""Device and host KV block pools, with automatic prefix caching. Moves block ids, never tensors (no torch).

Prefix caching: a full device block whose KV is computed is offered to the cache under a chained hash
of (its parent block's hash, its tokens), so a hash names the whole prefix up to the block's end. A
sequence that starts from scratch takes the longest chain of cached blocks matching its tokens and
computes only the rest. Device blocks are reference-counted: a cached block may sit in many block
tables at once, and is never written again (only full blocks are cached, and a sequence writes only
past its computed tokens). A block whose count drops to zero goes back to the free pool but keeps its
cache entry; allocation takes blocks that hold no cached KV first, then cached ones (an eviction):
those of the least urgent work first, least recently used first among equals (free_pool.py).

The host pool is a second tier: an evicted device block's KV is copied to a free host block (one that
no swapped-out sequence owns: their blocks are never dropped for the cache), where a later hit finds
it and copies it back instead of recomputing it. Free host blocks are handed out (for a swap-out or
another eviction) in the same order as device blocks. Copies are returned as block pairs
for the runner, which does a step's device-to-host copies before its host-to-device ones; a host
block written or read by this step's copies is reusable only from the next step (`start_step`).
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field

from batching.free_pool import FreeBlockPool
from batching.sequence import Sequence

ROOT_HASH = bytes(16)  # the parent of a sequence's first block


@dataclass(slots=True)
class CachedPrefix:
    """The cached blocks a sequence can start on: device blocks, then host blocks that continue the
    chain (each copied to a new device block when taken)."""

    device: list[int] = field(default_factory=list)
    host: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.device) + len(self.host)

    def pop(self) -> None:
        """Drop the last block."""
        (self.host or self.device).pop()


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def block_hash(parent: bytes, tokens: list[int], extra: bytes = b"") -> bytes:
    """Names a full block's KV: the hash of everything before it, its tokens, and `extra`: anything else
    that changes its KV (genq feeds token ids only, so nothing yet; extra model inputs would go here).
    A cryptographic hash: token ids come from users, and a collision would hand one request another's KV.
    """
    # (one call on the joined bytes: the same digest as updates of each, in half the time)
    return hashlib.blake2b(parent + array("q", tokens).tobytes() + extra, digest_size=16).digest()


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
        num_state_slots: int = 0,
        num_host_state_slots: int = 0,
        contiguous: bool = False,
    ):
        self.block_size = block_size
        # place each sequence's blocks one after another where the pool allows (FreeBlockPool.take_run):
        # for the CPU's attention; off, blocks come in the pool's order alone (exact LRU within a class)
        self.contiguous = contiguous
        self.num_device_blocks = num_device_blocks
        self.num_host_blocks = num_host_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.free_device = FreeBlockPool(range(num_device_blocks))
        self.free_host = FreeBlockPool(range(num_host_blocks))
        # host blocks that this step's copies read or write: free, but reusable only from the next
        # step on (start_step), as the runner copies after scheduling
        self.host_released: list[int] = []
        self.ref_counts = [0] * num_device_blocks
        # the most urgent priority among the sequences that used a block since it was handed out:
        # cached KV of urgent work is evicted last
        self.block_priority = [0] * num_device_blocks
        self.host_block_priority = [0] * num_host_blocks
        self.hash_of_block: list[bytes | None] = [None] * num_device_blocks
        self.cached: dict[bytes, int] = {}  # block hash -> device block holding that KV
        self.hash_of_host_block: list[bytes | None] = [None] * num_host_blocks
        self.host_cached: dict[bytes, int] = {}  # block hash -> free host block holding that KV
        # models with state layers (state_cache.py): one state slot per running sequence, a host slot
        # per swapped-out one; 0 slots: an attention-only model
        self.num_state_slots = num_state_slots
        self.num_host_state_slots = num_host_state_slots
        self.free_state_slots = list(range(num_state_slots - 1, -1, -1))
        self.free_host_state_slots = list(range(num_host_state_slots - 1, -1, -1))
        self.host_state_released: list[int] = []  # read by this step's swap-ins: free from the next step
        self.state_swap_out: list[tuple[int, int]] = []  # this step's (slot, host slot) copies
        self.state_swap_in: list[tuple[int, int]] = []  # this step's (host slot, slot) copies
        self.offloads: list[tuple[int, int]] = []  # this step's (device, host) copies of evicted blocks
        self.loads: list[tuple[int, int]] = []  # this step's (host, device) copies of host-tier hits
        # counters
        self.num_queried_tokens = 0  # tokens of sequences that started from scratch
        self.num_hit_tokens = 0  # of those, tokens whose KV came from the cache (either tier)
        self.num_host_hit_tokens = 0  # of those, tokens whose KV was copied back from the host tier
        self.num_evictions = 0  # cached device blocks handed out for other KV
        self.num_offloaded_blocks = 0  # of those, blocks whose KV was kept in the host tier

    def start_step(self) -> None:
        """A new step is being scheduled: host blocks that the last step's copies used are free again."""
        for b in self.host_released:
            self._free_host_block(b)
        self.host_released.clear()
        self.free_host_state_slots.extend(self.host_state_released)
        self.host_state_released.clear()

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's prefix-cache copies: (device -> host offloads, host -> device loads)."""
        copies = self.offloads, self.loads
        self.offloads, self.loads = [], []
        return copies

    def take_state_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's state slot copies: (slot -> host slot swap-outs, host slot -> slot swap-ins)."""
        copies = self.state_swap_out, self.state_swap_in
        self.state_swap_out, self.state_swap_in = [], []
        return copies

    # --- prefix cache -----------------------------------------------------------------------------

    def find_cached_prefix(self, seq: Sequence) -> CachedPrefix:
        """The blocks holding the longest cached prefix of `seq`'s tokens: on the device, then on the
        host (no change to any pool).

        Only for a sequence without KV; at least one token is always left to compute, so the step that
        finishes the prefill has logits to sample from."""
        hit = CachedPrefix()
        if not self.enable_prefix_caching or seq.num_computed_tokens or seq.block_table:
            return hit
        for h in self._hashes(seq, (seq.num_tokens - 1) // self.block_size):
            block = None if hit.host else self.cached.get(h)
            if block is not None:
                hit.device.append(block)
                continue
            block = self.host_cached.get(h)
            if block is None or block not in self.free_host:  # (in use by this step's copies)
                break
            hit.host.append(block)
        return hit

    def num_taken_by(self, hit: CachedPrefix) -> int:
        """Free device blocks that taking `hit` removes from the pool: the cached blocks nobody
        references, and one for each host block."""
        return sum(1 for b in hit.device if self.ref_counts[b] == 0) + len(hit.host)

    def take_cached_prefix(self, seq: Sequence, hit: CachedPrefix) -> None:
        """Start `seq` on the cached blocks `hit` (from find_cached_prefix; may be empty; the pool must
        have num_taken_by(hit) free blocks): its KV for their tokens exists, or is copied back from the
        host this step (`take_copies`). Counts the query for the hit rate."""
        assert not seq.num_computed_tokens and not seq.block_table, f"{seq} already has KV"
        assert self.num_taken_by(hit) <= len(self.free_device), "the pool cannot take this prefix"
        for b in hit.device:
            self._ref(b, seq.priority)
        seq.block_table = list(hit.device)
        for b in hit.host:  # read by this step's loads: nobody may overwrite them before
            self.free_host.remove(b)
            self.host_released.append(b)
        for b in hit.host:
            h = self.hash_of_host_block[b]
            assert h is not None, "a host-tier hit is a cached host block"
            [d] = self._take_blocks(seq, 1)
            self.loads.append((b, d))
            seq.block_table.append(d)
            if h not in self.cached:  # back in the device tier
                self.cached[h] = d
                self.hash_of_block[d] = h
        seq.num_cache_offered_blocks = len(hit)
        seq.num_computed_tokens = len(hit) * self.block_size
        self.num_queried_tokens += seq.num_tokens
        self.num_hit_tokens += seq.num_computed_tokens
        self.num_host_hit_tokens += len(hit.host) * self.block_size

    def reset_prefix_cache(self) -> None:
        """Forget every cached block nobody references (on both tiers), and zero the counters."""
        forgotten = [(b, h) for b in self.free_device if (h := self.hash_of_block[b]) is not None]
        for b, h in reversed(forgotten):  # to the front, in the order they had
            del self.cached[h]
            self.hash_of_block[b] = None
            self.free_device.remove(b)
            self.free_device.add(b, None)
        for b in self.free_host:
            if self.hash_of_host_block[b] is not None:
                self._uncache_host_block(b)
                self.free_host.remove(b)
                self.free_host.add(b, None)
        for b in self.host_released:  # free from the next step on; then uncached
            self._uncache_host_block(b)
        self.num_queried_tokens = self.num_hit_tokens = self.num_host_hit_tokens = 0
        self.num_evictions = self.num_offloaded_blocks = 0

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Offer `seq`'s full, computed device blocks to the cache (a prefix already cached elsewhere
        keeps its first block; this copy stays private and goes when freed)."""
        if not self.enable_prefix_caching:
            return
        table, offered = seq.block_table, seq.num_cache_offered_blocks
        full = min(seq.num_computed_tokens // self.block_size, len(table))
        if full <= offered:
            return
        hashes = seq.block_hashes if len(seq.block_hashes) >= full else self._hashes(seq, full)
        hash_of_block, cached = self.hash_of_block, self.cached
        for i in range(offered, full):
            b, h = table[i], hashes[i]
            if hash_of_block[b] is None and h not in cached:
                cached[h] = b
                hash_of_block[b] = h
        seq.num_cache_offered_blocks = full

    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The chained hashes of `seq`'s first `num_blocks` full blocks (what names them in the cache)."""
        return self._hashes(seq, num_blocks)[:num_blocks]

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
        return self.num_new_blocks(seq, num_new_tokens) <= len(
            self.free_device
        ) and not self._lacks_state_slot(seq)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[int] | None:
        """Give `seq` slots for `num_new_tokens` more tokens (and a state slot, if the model keeps
        states and it has none); None (and no change) if the pool is short."""
        n = self.num_new_blocks(seq, num_new_tokens)
        if n > len(self.free_device) or self._lacks_state_slot(seq):
            return None
        new = self._take_blocks(seq, n)
        seq.block_table.extend(new)
        if self.num_state_slots and seq.state_slot is None:
            seq.state_slot = self.free_state_slots.pop()
        return new

    def append_blocks(self, seqs: list[Sequence]) -> None:
        """One more block for each of `seqs`, decodes whose blocks are all full (and that hold their state
        slot, if the model keeps states): `allocate(seq, 1)` for each, the pool holding len(seqs) free blocks.
        Each takes the block after its last where the pool allows (FreeBlockPool.take_next); the others'
        come off the pool in one call, in the order one call each would take them."""
        assert len(seqs) <= len(self.free_device), "the pool cannot give a block to each"
        assert not any(self._lacks_state_slot(seq) for seq in seqs), seqs
        claim, take_next = self._claim, self.free_device.take_next
        elsewhere = seqs
        if self.contiguous:
            elsewhere = []
            for seq in seqs:
                block = take_next(seq.block_table[-1])
                if block is None:
                    elsewhere.append(seq)
                else:
                    claim(block, seq.priority)
                    seq.block_table.append(block)
        for seq, block in zip(elsewhere, self.free_device.pop_many(len(elsewhere)), strict=True):
            claim(block, seq.priority)
            seq.block_table.append(block)

    def cache_filled_blocks(self, seqs: list[Sequence]) -> None:
        """`cache_computed_blocks` for each of `seqs`: decodes whose last computed block has just filled, one
        block to hash each (the general way where it is not)."""
        if not self.enable_prefix_caching:
            return
        bs, hash_of_block, cached = self.block_size, self.hash_of_block, self.cached
        for seq in seqs:
            offered, hashes, table = seq.num_cache_offered_blocks, seq.block_hashes, seq.block_table
            full = seq.num_computed_tokens // bs
            if full <= offered:
                continue
            if full != offered + 1 or len(hashes) != offered or len(table) < full:
                self.cache_computed_blocks(seq)
                continue
            h = block_hash(hashes[-1] if offered else ROOT_HASH, seq.token_ids[offered * bs : full * bs])
            hashes.append(h)
            b = table[offered]
            if hash_of_block[b] is None and h not in cached:
                cached[h] = b
                hash_of_block[b] = h
            seq.num_cache_offered_blocks = full

    def _lacks_state_slot(self, seq: Sequence) -> bool:
        return bool(self.num_state_slots) and seq.state_slot is None and not self.free_state_slots

    def max_tokens_allocatable(self, seq: Sequence) -> int:
        """How many more tokens `seq` can get slots for with the blocks free now."""
        capacity = (len(seq.block_table) + len(self.free_device)) * self.block_size
        return max(0, capacity - seq.num_computed_tokens)

    def free(self, seq: Sequence) -> None:
        """Release all of `seq`'s device blocks (its computed full ones stay cached) and host blocks."""
        self.cache_computed_blocks(seq)
        self._release(seq.block_table)
        for b in seq.host_block_table:
            self.free_host.add(b, None)
        seq.block_table = []
        seq.host_block_table = []
        seq.num_cache_offered_blocks = 0
        if seq.state_slot is not None:
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = None
        if seq.host_state_slot is not None:
            self.free_host_state_slots.append(seq.host_state_slot)
            seq.host_state_slot = None

    def _take_blocks(self, seq: Sequence, n: int) -> list[int]:
        """`n` free device blocks for the end of `seq`'s table, placed where the pool allows so that its blocks
        run on in memory: after its last block, or for a table not begun, at the start of a free run with room
        for the tokens it may reach (FreeBlockPool.take_next, take_run); the pool's next blocks where not."""
        pool, table = self.free_device, seq.block_table
        if not n:
            return []
        if not self.contiguous:
            taken = pool.pop_many(n)
        else:
            taken = [] if table else pool.take_run(n, blocks_for(seq.max_num_tokens, self.block_size)) or []
            last = table[-1] if table else None
            while len(taken) < n:
                block = None if last is None else pool.take_next(last)
                last = pool.pop() if block is None else block
                taken.append(last)
        for block in taken:
            self._claim(block, seq.priority)
        return taken

    def _claim(self, block: int, priority: int) -> None:
        """`block`, just taken off the pool, for a sequence of `priority` (evicting the KV it may cache)."""
        h = self.hash_of_block[block]
        if h is not None:  # cached KV nobody references: evicted for new KV
            del self.cached[h]
            self.hash_of_block[block] = None
            self.num_evictions += 1
            self._offload(block, h)
        self.ref_counts[block] = 1
        self.block_priority[block] = priority

    def _offload(self, block: int, h: bytes) -> None:
        """Keep an evicted device block's KV in a free host block, if the host tier has one."""
        if h in self.host_cached or not self.free_host:
            return
        host = self._take_free_host_block()
        self.host_released.append(host)  # written by this step's copies
        self.host_cached[h] = host
        self.hash_of_host_block[host] = h
        self.host_block_priority[host] = self.block_priority[block]
        self.offloads.append((block, host))
        self.num_offloaded_blocks += 1

    def _take_free_host_block(self) -> int:
        block = self.free_host.pop()
        self._uncache_host_block(block)
        return block

    def _free_host_block(self, block: int) -> None:
        cached = self.hash_of_host_block[block] is not None
        self.free_host.add(block, self.host_block_priority[block] if cached else None)

    def _uncache_host_block(self, block: int) -> None:
        h = self.hash_of_host_block[block]
        if h is not None:
            del self.host_cached[h]
            self.hash_of_host_block[block] = None

    def _ref(self, block: int, priority: int) -> None:
        if self.ref_counts[block] == 0:
            self.free_device.remove(block)
            self.block_priority[block] = priority
        else:
            self.block_priority[block] = min(self.block_priority[block], priority)
        self.ref_counts[block] += 1

    def _release(self, table: list[int]) -> None:
        """Drop one reference to each block of `table`; unreferenced blocks go to the free pool, the
        table's tail first so that a prefix outlives its extensions."""
        for b in reversed(table):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                cached = self.hash_of_block[b] is not None
                self.free_device.add(b, self.block_priority[b] if cached else None)

    # --- swapping ---------------------------------------------------------------------------------

    def num_used_blocks(self, seq: Sequence) -> int:
        """Blocks that hold computed KV (the rest of the table, if any, is reserved but empty)."""
        return blocks_for(seq.num_computed_tokens, self.block_size)

    def can_swap_out(self, seq: Sequence) -> bool:
        lacks_slot = seq.state_slot is not None and not self.free_host_state_slots
        return self.num_used_blocks(seq) <= len(self.free_host) and not lacks_slot

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]] | None:
        """Copy `seq`'s computed blocks to host blocks of its own and release its device blocks (shared
        ones stay with their other owners, cached ones stay cached); returns (device, host) pairs to
        copy, or None."""
        n = self.num_used_blocks(seq)
        if not self.can_swap_out(seq):
            return None
        if seq.state_slot is not None:  # its state goes to a host slot with its blocks
            seq.host_state_slot = self.free_host_state_slots.pop()
            self.state_swap_out.append((seq.state_slot, seq.host_state_slot))
            self.free_state_slots.append(seq.state_slot)
            seq.state_slot = None
        self.cache_computed_blocks(seq)
        host = [self._take_free_host_block() for _ in range(n)]
        mapping = list(zip(seq.block_table[:n], host, strict=True))
        self._release(seq.block_table)
        seq.block_table = []
        seq.num_cache_offered_blocks = 0
        seq.host_block_table = host
        return mapping

    def can_swap_in(self, seq: Sequence, extra_blocks: int = 0) -> bool:
        lacks_slot = seq.host_state_slot is not None and not self.free_state_slots
        return len(seq.host_block_table) + extra_blocks <= len(self.free_device) and not lacks_slot

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]] | None:
        """Move `seq`'s host blocks back to device blocks; returns (host, device) pairs to copy, or None."""
        n = len(seq.host_block_table)
        if not self.can_swap_in(seq):
            return None
        if seq.host_state_slot is not None:
            seq.state_slot = self.free_state_slots.pop()
            self.state_swap_in.append((seq.host_state_slot, seq.state_slot))
            self.host_state_released.append(seq.host_state_slot)
            seq.host_state_slot = None
        device = self._take_blocks(seq, n)  # (its device table is empty)
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
    def num_cached_host_blocks(self) -> int:
        return len(self.host_cached)

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
        self.free_device.check()
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
        assert all(self.hash_of_host_block[b] == h for h, b in self.host_cached.items()), "host index corrupt"
        assert sum(h is not None for h in self.hash_of_host_block) == len(self.host_cached)
        assert not set(host_owned) & set(self.host_cached.values()), "a swapped-out block is in the cache"
        if self.num_state_slots:
            slots = [s.state_slot for s in live if s.state_slot is not None] + self.free_state_slots
            assert sorted(slots) == list(range(self.num_state_slots)), "state slot leaked or double-owned"
            host_slots = [s.host_state_slot for s in live if s.host_state_slot is not None]
            host_slots += self.free_host_state_slots + self.host_state_released
            assert sorted(host_slots) == list(range(self.num_host_state_slots)), "host state slot leaked"
            for s in live:
                assert (s.state_slot is not None) == bool(s.block_table), f"{s}: a state slot without blocks"
                assert (s.host_state_slot is not None) == bool(s.host_block_table), f"{s}: host slot mismatch"
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
