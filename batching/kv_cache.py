"""The KV tensors: a device pool and a host pool of the same geometry, and block copies between them.

Each layer's K and V are stored at their own size: layers of one geometry (KV heads, K and V head
sizes) share a pool tensor, so a uniform model has one, as it always had, while Gemma 4 (sliding
and full layers of different head sizes) has one per kind of layer and multi-head latent attention
(K and V of different head sizes) keeps K and V apart. A block id names the same block in every
pool; the bytes of a block are the real sum over the layers (`bytes_per_block`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_DIM = 3  # the block axis of every pool tensor


@dataclass(frozen=True, slots=True)
class LayerGeometry:
    """What one attention layer caches per token: KV heads x (K head size + V head size)."""

    num_kv_heads: int
    k_dim: int
    v_dim: int


class KVCache:
    """Per pool tensor (each group of layers with one geometry; K and V together when their head
    sizes match, else each in a pool of its own):

    device: [layers of the group, 2 (K, V) or 1, num_kv_heads, num_blocks, block_size, head_dim]
    host:   the same with num_host_blocks (pinned on CUDA)

    Head-major (unlike the usual [blocks, block_size, heads, dim]) because a layer's new keys arrive
    as [Hkv, T, D], and gathering a batch's context then yields [Hkv, B, L, D], contiguous for one
    batched matmul with no transposed copies. A swap copies the same blocks of every pool.
    """

    def __init__(
        self,
        layers: list[LayerGeometry | None],  # by layer index; None: the layer has no attention
        block_size: int,
        num_device_blocks: int,
        num_host_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.block_size = block_size
        self.device = device
        self.layers = list(layers)
        pin = device.type == "cuda"
        self.device_pools: list[torch.Tensor] = []
        self.host_pools: list[torch.Tensor] = []
        # per layer: views by slot [Hkv, num_blocks * block_size, D] for writes, by block
        # [Hkv, num_blocks, block_size * D] for gathers and the CPU kernel (a block of one head is contiguous)
        self.k: list[torch.Tensor | None] = [None] * len(layers)
        self.v: list[torch.Tensor | None] = [None] * len(layers)
        self.k_blocks: list[torch.Tensor | None] = [None] * len(layers)
        self.v_blocks: list[torch.Tensor | None] = [None] * len(layers)
        slots = num_device_blocks * block_size
        for geometry, members in _groups(self.layers).items():
            parts = [("kv", geometry.k_dim)] if geometry.k_dim == geometry.v_dim else []
            parts = parts or [("k", geometry.k_dim), ("v", geometry.v_dim)]
            for which, dim in parts:
                shape = (len(members), len(which), geometry.num_kv_heads, num_device_blocks, block_size, dim)
                pool = torch.zeros(shape, dtype=dtype, device=device)
                host_shape = (*shape[:BLOCK_DIM], num_host_blocks, *shape[BLOCK_DIM + 1 :])
                self.device_pools.append(pool)
                self.host_pools.append(torch.zeros(host_shape, dtype=dtype, pin_memory=pin))
                for i, layer in enumerate(members):
                    for j, name in enumerate(which):
                        by_slot = pool[i, j].view(geometry.num_kv_heads, slots, dim)
                        by_block = pool[i, j].flatten(2)
                        if name == "k":
                            self.k[layer], self.k_blocks[layer] = by_slot, by_block
                        else:
                            self.v[layer], self.v_blocks[layer] = by_slot, by_block
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._in_flight: list[torch.Tensor] = []  # staging tensors alive until their copy is waited on
        # gather buffers reused by every layer and step: fresh large tensors would page-fault each time
        self._workspace = {
            "k": torch.empty(0, dtype=dtype, device=device),
            "v": torch.empty(0, dtype=dtype, device=device),
        }

    @staticmethod
    def bytes_per_block(layers: list[LayerGeometry | None], block_size: int, dtype: torch.dtype) -> int:
        """A block's bytes in every pool together: the sum over the layers of their own sizes."""
        per_token = sum(g.num_kv_heads * (g.k_dim + g.v_dim) for g in layers if g is not None)
        return per_token * block_size * dtype.itemsize

    def gather(self, layer: int, block_ids: torch.Tensor, workspace_offset: int = 0):
        """K and V of `block_ids` (flat [n]) as [Hkv, n * block_size, Dk] and [.., Dv], in reused buffers.

        Views stay valid until the next gather that overlaps [workspace_offset, + its size).
        """
        n = block_ids.numel()
        out = []
        for name, pool in (("k", self.k_blocks[layer]), ("v", self.v_blocks[layer])):
            assert pool is not None, f"layer {layer} has no KV cache"
            heads, row = pool.shape[0], pool.shape[2]  # row: block_size * D
            size = heads * n * row
            buf = self._workspace[name]
            if buf.numel() < workspace_offset + size:
                buf = self._workspace[name] = torch.empty(
                    2 * (workspace_offset + size), dtype=buf.dtype, device=buf.device
                )
            view = buf[workspace_offset : workspace_offset + size].view(heads, n, row)
            torch.index_select(pool, 1, block_ids, out=view)
            out.append(view.view(heads, n * self.block_size, row // self.block_size))
        return out

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: mapping = [(device block, host block), ...]."""
        if not mapping:
            return
        if self.copy_stream is None:  # no CUDA: both pools are host memory
            _copy_runs(self.device_pools, self.host_pools, mapping)
            return
        src = torch.tensor([d for d, _ in mapping], device=self.device)
        dst = torch.tensor([h for _, h in mapping])
        with self._on_copy_stream():
            for device_pool, host_pool in zip(self.device_pools, self.host_pools):
                staged = device_pool.index_select(BLOCK_DIM, src)  # [Lg, 2, Hkv, n, bs, D]
                host_pool.index_copy_(BLOCK_DIM, dst, staged.to("cpu"))

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """Copy host blocks to device blocks: mapping = [(host block, device block), ...]."""
        if not mapping:
            return
        if self.copy_stream is None:  # no CUDA: both pools are host memory
            _copy_runs(self.host_pools, self.device_pools, mapping)
            return
        src = torch.tensor([h for h, _ in mapping])
        dst = torch.tensor([d for _, d in mapping], device=self.device)
        with self._on_copy_stream():
            for device_pool, host_pool in zip(self.device_pools, self.host_pools):
                staged = host_pool.index_select(BLOCK_DIM, src).pin_memory()  # [Lg, 2, Hkv, n, bs, D]
                self._in_flight.append(staged)
                device_pool.index_copy_(BLOCK_DIM, dst, staged.to(self.device, non_blocking=True))

    def wait_for_copies(self) -> None:
        """Make the compute stream wait for swaps issued so far (the next forward reads those blocks)."""
        if self.copy_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
        self._in_flight.clear()

    def _on_copy_stream(self):
        assert self.copy_stream is not None
        # swaps read blocks the previous forward wrote: order them after it
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.copy_stream)


def _groups(layers: list[LayerGeometry | None]) -> dict[LayerGeometry, list[int]]:
    """Layer indices by geometry, in order of first appearance."""
    groups: dict[LayerGeometry, list[int]] = {}
    for layer, geometry in enumerate(layers):
        if geometry is not None:
            groups.setdefault(geometry, []).append(layer)
    return groups


def _copy_runs(
    src_pools: list[torch.Tensor], dst_pools: list[torch.Tensor], mapping: list[tuple[int, int]]
) -> None:
    """Copy blocks between two sets of pools in one pass, a slice per run of consecutive ids on both sides.

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
        for src_pool, dst_pool in zip(src_pools, dst_pools):
            dst_pool.narrow(BLOCK_DIM, dst, n).copy_(src_pool.narrow(BLOCK_DIM, src, n))
        start = i
