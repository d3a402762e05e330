"""The KV tensors: a device pool and a host pool of the same geometry, and block copies between them."""

from __future__ import annotations

import torch


class KVCache:
    """K and V of every layer in one tensor per pool, so a swap is one gather and one scatter.

    device: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    host:   [num_layers, 2, num_host_blocks, block_size, num_kv_heads, head_dim] (pinned on CUDA)
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 num_device_blocks: int, num_host_blocks: int, dtype: torch.dtype, device: torch.device):
        self.block_size = block_size
        self.device = device
        shape = (num_layers, 2, num_device_blocks, block_size, num_kv_heads, head_dim)
        self.device_cache = torch.zeros(shape, dtype=dtype, device=device)
        host_shape = (num_layers, 2, num_host_blocks, block_size, num_kv_heads, head_dim)
        pin = device.type == "cuda"
        self.host_cache = torch.zeros(host_shape, dtype=dtype, pin_memory=pin)
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._in_flight: list[torch.Tensor] = []   # staging tensors alive until their copy is waited on
        # flat per-layer views: [num_blocks * block_size, num_kv_heads, head_dim]
        slots = num_device_blocks * block_size
        self.k = [self.device_cache[i, 0].view(slots, num_kv_heads, head_dim) for i in range(num_layers)]
        self.v = [self.device_cache[i, 1].view(slots, num_kv_heads, head_dim) for i in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                        dtype: torch.dtype) -> int:
        return num_layers * 2 * block_size * num_kv_heads * head_dim * dtype.itemsize

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: mapping = [(device block, host block), ...]."""
        if not mapping:
            return
        src = torch.tensor([d for d, _ in mapping], device=self.device)
        dst = torch.tensor([h for _, h in mapping])
        with self._on_copy_stream():
            staged = self.device_cache.index_select(2, src)                    # [L, 2, n, bs, Hkv, D]
            self.host_cache.index_copy_(2, dst, staged.to("cpu"))

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """Copy host blocks to device blocks: mapping = [(host block, device block), ...]."""
        if not mapping:
            return
        src = torch.tensor([h for h, _ in mapping])
        dst = torch.tensor([d for _, d in mapping], device=self.device)
        with self._on_copy_stream():
            staged = self.host_cache.index_select(2, src)                      # [L, 2, n, bs, Hkv, D]
            if self.copy_stream is not None:
                staged = staged.pin_memory()
                self._in_flight.append(staged)
            self.device_cache.index_copy_(2, dst, staged.to(self.device, non_blocking=True))

    def wait_for_copies(self) -> None:
        """Make the compute stream wait for swaps issued so far (the next forward reads those blocks)."""
        if self.copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
        self._in_flight.clear()

    def _on_copy_stream(self):
        if self.copy_stream is None:
            return _NullContext()
        # swaps read blocks the previous forward wrote: order them after it
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.copy_stream)


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
