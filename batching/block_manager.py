"""Device and host KV block pools. Moves block ids, never tensors (no torch here)."""

from __future__ import annotations

from collections import deque

from batching.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    """Owns the free lists. A sequence's blocks live in `seq.block_table` / `seq.host_block_table`.

    Every `can_*` check has an act that either happens whole or returns None (never half-happens).
    """

    def __init__(self, num_device_blocks: int, num_host_blocks: int, block_size: int):
        self.block_size = block_size
        self.num_device_blocks = num_device_blocks
        self.num_host_blocks = num_host_blocks
        self.free_device: deque[int] = deque(range(num_device_blocks))
        self.free_host: deque[int] = deque(range(num_host_blocks))

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
        new = [self.free_device.popleft() for _ in range(n)]
        seq.block_table.extend(new)
        return new

    def max_tokens_allocatable(self, seq: Sequence) -> int:
        """How many more tokens `seq` can get slots for with the blocks free now."""
        capacity = (len(seq.block_table) + len(self.free_device)) * self.block_size
        return max(0, capacity - seq.num_computed_tokens)

    def free(self, seq: Sequence) -> None:
        """Return all of `seq`'s device and host blocks."""
        self.free_device.extend(seq.block_table)
        self.free_host.extend(seq.host_block_table)
        seq.block_table = []
        seq.host_block_table = []

    # --- swapping ---------------------------------------------------------------------------------

    def num_used_blocks(self, seq: Sequence) -> int:
        """Blocks that hold computed KV (the rest of the table, if any, is reserved but empty)."""
        return blocks_for(seq.num_computed_tokens, self.block_size)

    def can_swap_out(self, seq: Sequence) -> bool:
        return self.num_used_blocks(seq) <= len(self.free_host)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]] | None:
        """Move `seq`'s computed blocks to host blocks; returns (device, host) pairs to copy, or None."""
        n = self.num_used_blocks(seq)
        if n > len(self.free_host):
            return None
        host = [self.free_host.popleft() for _ in range(n)]
        mapping = list(zip(seq.block_table[:n], host, strict=True))
        self.free_device.extend(seq.block_table)
        seq.block_table = []
        seq.host_block_table = host
        return mapping

    def can_swap_in(self, seq: Sequence, extra_blocks: int = 0) -> bool:
        return len(seq.host_block_table) + extra_blocks <= len(self.free_device)

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]] | None:
        """Move `seq`'s host blocks back to device blocks; returns (host, device) pairs to copy, or None."""
        n = len(seq.host_block_table)
        if n > len(self.free_device):
            return None
        device = [self.free_device.popleft() for _ in range(n)]
        mapping = list(zip(seq.host_block_table, device, strict=True))
        self.free_host.extend(seq.host_block_table)
        seq.host_block_table = []
        seq.block_table = device
        return mapping

    # --- gauges and checks ------------------------------------------------------------------------

    @property
    def num_free_device_blocks(self) -> int:
        return len(self.free_device)

    @property
    def num_free_host_blocks(self) -> int:
        return len(self.free_host)

    def device_usage(self) -> float:
        return 1.0 - len(self.free_device) / self.num_device_blocks

    def host_usage(self) -> float:
        return 1.0 - len(self.free_host) / self.num_host_blocks if self.num_host_blocks else 0.0

    def check_invariants(self, live: list[Sequence]) -> None:
        """Every block is free or owned by exactly one live sequence; tables cover the computed tokens."""
        device_owned = [b for s in live for b in s.block_table]
        host_owned = [b for s in live for b in s.host_block_table]
        all_device = device_owned + list(self.free_device)
        all_host = host_owned + list(self.free_host)
        assert sorted(all_device) == list(range(self.num_device_blocks)), (
            "device block leaked or double-owned"
        )
        assert sorted(all_host) == list(range(self.num_host_blocks)), "host block leaked or double-owned"
        for s in live:
            assert not (s.block_table and s.host_block_table), f"{s} holds device and host blocks at once"
            table = s.host_block_table or s.block_table
            assert len(table) * self.block_size >= s.num_computed_tokens, f"{s} lacks blocks for its KV"
