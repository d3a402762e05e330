"""Free KV blocks in the order they are handed out, so that cached KV of urgent work goes last. No torch."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator

NUM_PRIORITIES = 10  # request priorities 0 (most urgent) .. 9


class FreeBlockPool:
    """Free blocks, handed out in this order: blocks holding no cached KV (those freed last first),
    then cached blocks by the priority of the most urgent work that used them, least urgent class
    first (9, then 8, ... 0), least recently freed first within a class. An eviction therefore takes
    cached KV of bulk work before that of urgent work, and old entries before recent ones."""

    def __init__(self, blocks: Iterable[int]):
        self._uncached: OrderedDict[int, None] = OrderedDict.fromkeys(blocks)
        self._cached: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(NUM_PRIORITIES)]
        self._where: dict[int, OrderedDict] = {b: self._uncached for b in self._uncached}

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
        else:
            pool = self._cached[priority]
            pool[block] = None
        self._where[block] = pool

    def remove(self, block: int) -> None:
        """Take a given free block (a cache hit on it)."""
        del self._where.pop(block)[block]

    def pop_many(self, n: int) -> list[int]:
        """Hand out the next `n` blocks, in the order `n` calls of pop() would (the pool must hold them)."""
        taken: list[int] = []
        where = self._where
        while len(taken) < n:
            pool = self._uncached if self._uncached else next(p for p in reversed(self._cached) if p)
            for _ in range(min(n - len(taken), len(pool))):
                block, _ = pool.popitem(last=False)
                del where[block]
                taken.append(block)
        return taken

    def pop(self) -> int:
        """Hand out the next block (the pool must not be empty)."""
        pool = self._uncached if self._uncached else next(p for p in reversed(self._cached) if p)
        block, _ = pool.popitem(last=False)
        del self._where[block]
        return block
