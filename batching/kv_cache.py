"""The KV tensors: a device pool and a host pool of the same geometry, and block copies between them."""

from __future__ import annotations

import torch

BLOCK_DIM = 3  # the block axis of the pools


class KVCache:
    """K and V of every layer in one tensor per pool, so a swap is one gather and one scatter.

    device: [num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim]
    host:   [num_layers, 2, num_kv_heads, num_host_blocks, block_size, head_dim] (pinned on CUDA)

    Head-major (unlike the usual [blocks, block_size, heads, dim]) because a layer's new keys arrive
    as [Hkv, T, D], and gathering a batch's context then yields [Hkv, B, L, D], contiguous for one
    batched matmul with no transposed copies.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        num_device_blocks: int,
        num_host_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.block_size = block_size
        self.device = device
        shape = (num_layers, 2, num_kv_heads, num_device_blocks, block_size, head_dim)
        self.device_cache = torch.zeros(shape, dtype=dtype, device=device)
        host_shape = (num_layers, 2, num_kv_heads, num_host_blocks, block_size, head_dim)
        pin = device.type == "cuda"
        self.host_cache = torch.zeros(host_shape, dtype=dtype, pin_memory=pin)
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._in_flight: list[torch.Tensor] = []  # staging tensors alive until their copy is waited on
        # per-layer views: by slot [Hkv, num_blocks * block_size, D] for writes, by block
        # [Hkv, num_blocks, block_size * D] for gathers (a block of one head is contiguous)
        slots = num_device_blocks * block_size
        self.k = [self.device_cache[i, 0].view(num_kv_heads, slots, head_dim) for i in range(num_layers)]
        self.v = [self.device_cache[i, 1].view(num_kv_heads, slots, head_dim) for i in range(num_layers)]
        self.k_blocks = [self.device_cache[i, 0].flatten(2) for i in range(num_layers)]
        self.v_blocks = [self.device_cache[i, 1].flatten(2) for i in range(num_layers)]
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        # gather buffers reused by every layer and step: fresh large tensors would page-fault each time
        self._workspace = {
            "k": torch.empty(0, dtype=dtype, device=device),
            "v": torch.empty(0, dtype=dtype, device=device),
        }

    @staticmethod
    def bytes_per_block(
        num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
    ) -> int:
        return num_layers * 2 * block_size * num_kv_heads * head_dim * dtype.itemsize

    def gather(self, layer: int, block_ids: torch.Tensor, workspace_offset: int = 0):
        """K and V of `block_ids` (flat [n]) as [Hkv, n * block_size, D] each, in reused buffers.

        Views stay valid until the next gather that overlaps [workspace_offset, + its size).
        """
        n = block_ids.numel()
        size = self.num_kv_heads * n * self.block_size * self.head_dim
        out = []
        for name, pool in (("k", self.k_blocks[layer]), ("v", self.v_blocks[layer])):
            buf = self._workspace[name]
            if buf.numel() < workspace_offset + size:
                buf = self._workspace[name] = torch.empty(
                    2 * (workspace_offset + size), dtype=buf.dtype, device=buf.device
                )
            view = buf[workspace_offset : workspace_offset + size].view(self.num_kv_heads, n, -1)
            torch.index_select(pool, 1, block_ids, out=view)
            out.append(view.view(self.num_kv_heads, n * self.block_size, self.head_dim))
        return out

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: mapping = [(device block, host block), ...]."""
        if not mapping:
            return
        if self.copy_stream is None:  # no CUDA: both pools are host memory
            _copy_runs(self.device_cache, self.host_cache, mapping)
            return
        src = torch.tensor([d for d, _ in mapping], device=self.device)
        dst = torch.tensor([h for _, h in mapping])
        with self._on_copy_stream():
            staged = self.device_cache.index_select(BLOCK_DIM, src)  # [L, 2, Hkv, n, bs, D]
            self.host_cache.index_copy_(BLOCK_DIM, dst, staged.to("cpu"))

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """Copy host blocks to device blocks: mapping = [(host block, device block), ...]."""
        if not mapping:
            return
        if self.copy_stream is None:  # no CUDA: both pools are host memory
            _copy_runs(self.host_cache, self.device_cache, mapping)
            return
        src = torch.tensor([h for h, _ in mapping])
        dst = torch.tensor([d for _, d in mapping], device=self.device)
        with self._on_copy_stream():
            staged = self.host_cache.index_select(BLOCK_DIM, src)  # [L, 2, Hkv, n, bs, D]
            if self.copy_stream is not None:
                staged = staged.pin_memory()
                self._in_flight.append(staged)
            self.device_cache.index_copy_(BLOCK_DIM, dst, staged.to(self.device, non_blocking=True))

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


def _copy_runs(src_pool: torch.Tensor, dst_pool: torch.Tensor, mapping: list[tuple[int, int]]) -> None:
    """Copy blocks between two pools in one pass, a slice per run of consecutive ids on both sides.

    On the CPU both pools are host memory: gathering into a staging tensor and scattering it (the
    CUDA path's index_select + index_copy_) moves every byte twice, and a swap of ~80 cold blocks
    took ~2 ms inside a step; runs (blocks are handed out in order, so a sequence's are mostly
    consecutive) move it once."""
    start = 0
    for i in range(1, len(mapping) + 1):
        if (
            i < len(mapping)
            and mapping[i][0] == mapping[i - 1][0] + 1
            and mapping[i][1] == mapping[i - 1][1] + 1
        ):
            continue
        (src, dst), n = mapping[start], i - start
        dst_pool.narrow(BLOCK_DIM, dst, n).copy_(src_pool.narrow(BLOCK_DIM, src, n))
        start = i


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
