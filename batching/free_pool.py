"""Free KV blocks in the order they are handed out, so that cached KV of urgent work goes last, and placed so
that a sequence's blocks sit one after another in memory where the pool allows. No torch."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from itertools import islice

NUM_PRIORITIES = 10  # request priorities 0 (most urgent) .. 9

OLDEST_SHARE = 4  # placement takes a cached block only among the oldest quarter of its class,
OLDEST_MAX = 4096  # and its oldest 4,096 at most (what a placement scans: ~0.1 ms in a pool of any size)
IN_USE, UNCACHED = 0, 1  # a block's state in the pool's map; a free cached block of class c: CACHED + c
CACHED = 2
_UNCACHED_ONLY = bytes(int(s == UNCACHED) for s in range(256))  # translate(): the map, uncached blocks 1


class FreeBlockPool:
    """Free blocks, handed out in this order: blocks holding no cached KV (those freed last first),
    then cached blocks by the priority of the most urgent work that used them, least urgent class
    first (9, then 8, ... 0), least recently freed first within a class. An eviction therefore takes
    cached KV of bulk work before that of urgent work, and old entries before recent ones.

    Placement (`take_next`, `take_run`), for the CPU's attention, which reads a run of blocks faster than
    scattered ones (bench/RESULTS.md): among the blocks the pool hands out next (the uncached ones while any
    are free, else the cached ones of the least urgent class held), a growing sequence takes the block
    after its last, and a new one the start of a run with room for its expected length. The order of the
    tiers stays; within the class evicted, placement takes only among its oldest quarter, so the KV freed
    most recently is evicted last as before."""

    def __init__(self, blocks: Iterable[int]):
        blocks = list(blocks)
        self._uncached: OrderedDict[int, None] = OrderedDict.fromkeys(blocks)
        self._cached: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(NUM_PRIORITIES)]
        self._where: dict[int, OrderedDict] = {b: self._uncached for b in self._uncached}
        self._state = bytearray(max(blocks, default=-1) + 1)  # by block: IN_USE, UNCACHED or CACHED + class
        for b in blocks:
            self._state[b] = UNCACHED
        self._cursor = 0  # where the next run is looked for: after the last one placed (next fit)
        self._freed_at = [0] * len(self._state)  # by cached block: when it joined its class (a clock of adds)
        self._clock = 0

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, block: int) -> bool:
        return block in self._where

    def __iter__(self) -> Iterator[int]:
        return iter(list(self._where))

    def add(self, block: int, priority: int | None) -> None:
        """Free `block`; `priority`: of the most urgent work whose cached KV it holds, None if it holds
        none (then it is handed out before any cached block)."""
        assert block not in self._where, f"block {block} freed twice"
        if priority is None:
            pool = self._uncached
            pool[block] = None
            pool.move_to_end(block, last=False)
            self._state[block] = UNCACHED
        else:
            pool = self._cached[priority]
            pool[block] = None
            self._state[block] = CACHED + priority
            self._freed_at[block] = self._clock
            self._clock += 1
        self._where[block] = pool

    def remove(self, block: int) -> None:
        """Take a given free block (a cache hit on it)."""
        del self._where.pop(block)[block]
        self._state[block] = IN_USE

    def pop_many(self, n: int) -> list[int]:
        """Hand out the next `n` blocks, in the order `n` calls of pop() would (the pool must hold them)."""
        taken: list[int] = []
        where, state = self._where, self._state
        while len(taken) < n:
            pool = self._uncached if self._uncached else next(p for p in reversed(self._cached) if p)
            for _ in range(min(n - len(taken), len(pool))):
                block, _ = pool.popitem(last=False)
                del where[block]
                state[block] = IN_USE
                taken.append(block)
        return taken

    def pop(self) -> int:
        """Hand out the next block (the pool must not be empty)."""
        pool = self._uncached if self._uncached else next(p for p in reversed(self._cached) if p)
        block, _ = pool.popitem(last=False)
        del self._where[block]
        self._state[block] = IN_USE
        return block

    def take_next(self, block: int) -> int | None:
        """`block + 1`, taken, if it is free among the blocks handed out next (uncached ones, or the oldest
        share of the class evicted next); else None."""
        following = block + 1
        if following >= len(self._state) or self._state[following] != self._next_state():
            return None
        tier = self._where[following]
        if tier is not self._uncached:  # within the oldest share of its class (a bound: the clock only rises)
            if self._freed_at[following] - self._freed_at[next(iter(tier))] >= self._window(tier):
                return None
        self.remove(following)
        return following

    def take_run(self, n: int, room: int) -> list[int] | None:
        """`n` blocks in a row, taken from the start of a run of `room` free ones among those handed out
        next (uncached ones, or the oldest share of the class evicted next), looked for from where the last
        run ended: a new sequence gets room to grow in place. Less room (halved down to `n`) where no such
        run is free; None where not even `n` are."""
        state = self._next_state()
        if state == IN_USE:
            return None
        if state == UNCACHED:
            eligible = self._state.translate(_UNCACHED_ONLY)
        else:
            tier = self._cached[state - CACHED]
            eligible = bytearray(len(self._state))
            for block in islice(tier, self._window(tier)):
                eligible[block] = 1
        room = max(room, n)
        while True:
            run = b"\x01" * room
            start = eligible.find(run, self._cursor)
            if start < 0:
                start = eligible.find(run)
            if start >= 0:
                break
            if room == n:
                return None
            room = max(n, room // 2)
        taken = list(range(start, start + n))
        for block in taken:
            self.remove(block)
        self._cursor = start + room
        return taken

    @staticmethod
    def _window(tier: OrderedDict) -> int:
        """How many of a cached class's oldest blocks placement may take out of order: a quarter (at least 1,
        at most OLDEST_MAX), so that what was freed recently stays cached as long as before."""
        return max(1, min(len(tier) // OLDEST_SHARE, OLDEST_MAX))

    def check(self) -> None:
        """The map of states agrees with the tiers (for BlockManager.check_invariants)."""
        state_of_tier = {id(self._uncached): UNCACHED} | {
            id(p): CACHED + c for c, p in enumerate(self._cached)
        }
        for block, state in enumerate(self._state):
            tier = self._where.get(block)
            want = IN_USE if tier is None else state_of_tier[id(tier)]
            assert state == want, f"block {block}: state {state} in the map, {want} in the tiers"

    def _next_state(self) -> int:
        """The state of the blocks pop() hands out now: UNCACHED, or CACHED + the least urgent class held;
        IN_USE where the pool is empty."""
        if self._uncached:
            return UNCACHED
        for priority in range(NUM_PRIORITIES - 1, -1, -1):
            if self._cached[priority]:
                return CACHED + priority
        return IN_USE
