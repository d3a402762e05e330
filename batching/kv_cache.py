"""The KV tensors: a device pool and a host pool of the same geometry, and block copies between them.

Each layer's K and V are stored at their own size: layers of one geometry (KV heads, K and V head
sizes) share a pool tensor, so a uniform model has one, as it always had, while Gemma 4 (sliding
and full layers of different head sizes) has one per kind of layer and multi-head latent attention
(K and V of different head sizes) keeps K and V apart. A block id names the same block in every
pool; the bytes of a block are the real sum over the layers (`bytes_per_block`).

With `kv_cache_dtype="int8"` every K and V row (one token, one KV head) is stored as int8 with one
bfloat16 scale (`quantize`): x ~ q * s, s = max|x| / 127 rounded up, so |q| <= 127. The scales
live in pools of their own, beside the data pools and with the same block axis, so swaps and the
prefix cache's host tier copy them with the data and bring back exactly what was stored. A scale
per token makes a block's bytes depend on its own tokens only: a prefix cached from one sequence
holds what another would write. Each attention path dequantizes as it reads: q * s is exact in
float32 (8 bits times 8 bits of mantissa), so every path attends over the same values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

BLOCK_DIM = 3  # the block axis of every pool tensor
SCALE_DTYPE = torch.bfloat16  # int8 caches: float32's range in 2 bytes (a scale may be tiny or huge)
# s = max|x| / 127 x (1 + 2^-8) before rounding to bfloat16 (relative error <= 2^-9): s >= max|x| / 127
SCALE_HEADROOM = 1.0 + 2.0**-8


@dataclass(frozen=True, slots=True)
class LayerGeometry:
    """What one attention layer caches per token: KV heads x (K head size + V head size)."""

    num_kv_heads: int
    k_dim: int
    v_dim: int


class KVCache:
    """Per pool tensor (each group of layers with one geometry; K and V together when their head
    sizes match, else each in a pool of its own):

    device: [layers of the group, 2 (K, V) or 1, num_kv_heads, num_blocks (+1 scratch), block_size, head_dim]
    host:   [num_host_blocks, layers of the group, 2 or 1, num_kv_heads, block_size, head_dim] (pinned on CUDA)

    int8 caches (`quantized`): those pools hold int8, and each has a scale pool beside it, the same
    shape without head_dim, in bfloat16 (`device_pools` and `host_pools` list the data pools, then
    the scale pools: a swap copies all of them).

    The device pools are head-major (unlike the usual [blocks, block_size, heads, dim]) because a
    layer's new keys arrive as [Hkv, T, D], and a block of one head is then contiguous for the
    attention kernels. The host pools are block-major: a host block is one contiguous run of bytes,
    so a swap moves each run of consecutive host blocks in one copy. A swap copies the same blocks
    of every pool. The device pools hold one block more than the block manager hands out, the
    scratch block, where the padded rows of a CUDA graph's batch write their keys.

    Streams (CUDA). Swaps run on `copy_stream`, after the work already queued on the compute stream
    (the forward that wrote the blocks). Swap-out gathers the blocks into a device staging buffer and
    copies it to the pinned host pool asynchronously; swap-in copies host blocks into a staging
    buffer and scatters them into the pools. An event after the gathers and scatters (not after the
    device-to-host copies) is what the compute stream waits on (`wait_for_copies`), so the next
    forward may reuse a swapped-out block and reads swapped-in ones, while the copies to host memory
    overlap it. Every tensor the copy stream touches is allocated on it (index tensors and staging
    buffers), so the caching allocator never hands their memory to the compute stream early. The
    host side of a copy to host memory is complete once `sync_host()` returns (the CPU reads host
    blocks only in tests and inspection).
    """

    def __init__(
        self,
        layers: list[LayerGeometry | None],  # by layer index; None: the layer has no attention
        block_size: int,
        num_device_blocks: int,
        num_host_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_cache_dtype: str = "auto",
    ):
        self.block_size = block_size
        self.device = device
        self.dtype = dtype  # the model's: what `gather` returns
        self.quantized = kv_cache_dtype == "int8"
        storage = torch.int8 if self.quantized else dtype
        self.layers = list(layers)
        self.num_device_blocks = num_device_blocks
        self.scratch_slot = num_device_blocks * block_size  # the first slot of the scratch block
        pin = device.type == "cuda"
        self.device_pools: list[torch.Tensor] = []
        self.host_pools: list[torch.Tensor] = []
        # per layer: views by slot [Hkv, num_blocks * block_size, D] for writes, by block
        # [Hkv, num_blocks, block_size * D] for gathers and the kernels (a block of one head is contiguous)
        self.k: list[torch.Tensor | None] = [None] * len(layers)
        self.v: list[torch.Tensor | None] = [None] * len(layers)
        self.k_blocks: list[torch.Tensor | None] = [None] * len(layers)
        self.v_blocks: list[torch.Tensor | None] = [None] * len(layers)
        # int8 caches: per layer, the scales by slot [Hkv, num_blocks * block_size] and by block
        # [Hkv, num_blocks, block_size]
        self.k_scales: list[torch.Tensor | None] = [None] * len(layers)
        self.v_scales: list[torch.Tensor | None] = [None] * len(layers)
        self.k_scale_blocks: list[torch.Tensor | None] = [None] * len(layers)
        self.v_scale_blocks: list[torch.Tensor | None] = [None] * len(layers)
        scale_pools: list[torch.Tensor] = []
        scale_host_pools: list[torch.Tensor] = []
        slots = (num_device_blocks + 1) * block_size
        for geometry, members in _groups(self.layers).items():
            parts = [("kv", geometry.k_dim)] if geometry.k_dim == geometry.v_dim else []
            parts = parts or [("k", geometry.k_dim), ("v", geometry.v_dim)]
            for which, dim in parts:
                shape = (
                    len(members),
                    len(which),
                    geometry.num_kv_heads,
                    num_device_blocks + 1,
                    block_size,
                    dim,
                )
                pool = torch.zeros(shape, dtype=storage, device=device)
                host_shape = (num_host_blocks, *shape[:BLOCK_DIM], *shape[BLOCK_DIM + 1 :])
                self.device_pools.append(pool)
                # empty: a host block is read only after a swap-out wrote it, and on the CPU zeroing the pool
                # is most of an engine's start (1 GiB at the default width: seconds on a loaded machine)
                self.host_pools.append(torch.empty(host_shape, dtype=storage, pin_memory=pin))
                if self.quantized:
                    scales = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=device)
                    scale_pools.append(scales)
                    scale_host_pools.append(torch.empty(host_shape[:-1], dtype=SCALE_DTYPE, pin_memory=pin))
                for i, layer in enumerate(members):
                    for j, name in enumerate(which):
                        by_slot = pool[i, j].view(geometry.num_kv_heads, slots, dim)
                        by_block = pool[i, j].flatten(2)
                        if name == "k":
                            self.k[layer], self.k_blocks[layer] = by_slot, by_block
                        else:
                            self.v[layer], self.v_blocks[layer] = by_slot, by_block
                        if self.quantized:
                            scale_by_block = scales[i, j]  # [Hkv, num_blocks, block_size]
                            scale_by_slot = scale_by_block.view(geometry.num_kv_heads, slots)
                            if name == "k":
                                self.k_scales[layer], self.k_scale_blocks[layer] = (
                                    scale_by_slot,
                                    scale_by_block,
                                )
                            else:
                                self.v_scales[layer], self.v_scale_blocks[layer] = (
                                    scale_by_slot,
                                    scale_by_block,
                                )
        self.device_pools += scale_pools
        self.host_pools += scale_host_pools
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # CPU pools: the C++ row write (cpu_attention's `write_rows`), set by the engine's builder where the
        # kernels are loaded; else (and for int8 caches) index_copy_
        self.row_writer: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None
        self._ready: torch.cuda.Event | None = None  # the last swap's device-side work
        # gather buffers reused by every layer and step: fresh large tensors would page-fault each time
        self._workspace = {
            "k": torch.empty(0, dtype=dtype, device=device),
            "v": torch.empty(0, dtype=dtype, device=device),
            "int8": torch.empty(0, dtype=torch.int8, device=device),  # int8 caches: the gathered data
        }

    @staticmethod
    def bytes_per_block(
        layers: list[LayerGeometry | None], block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
    ) -> int:
        """A block's bytes in every pool together: the sum over the layers of their own sizes (int8
        caches: a byte an element, plus a K and a V scale per token and KV head)."""
        per_token = sum(g.num_kv_heads * (g.k_dim + g.v_dim) for g in layers if g is not None)
        if kv_cache_dtype == "int8":
            scales = sum(2 * g.num_kv_heads for g in layers if g is not None)
            return (per_token + scales * SCALE_DTYPE.itemsize) * block_size
        return per_token * block_size * dtype.itemsize

    def write(self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store a step's new K/V of one layer in their slots. key: [Hkv, T, Dk]; value: [Hkv, T, Dv]."""
        k_cache, v_cache = self.k[layer], self.v[layer]
        assert k_cache is not None and v_cache is not None, f"layer {layer} has no KV cache"
        if not self.quantized:
            if self.row_writer is not None and key.stride(-1) == 1 and value.stride(-1) == 1:
                self.row_writer(k_cache, slot_mapping, key)
                self.row_writer(v_cache, slot_mapping, value)
                return
            k_cache.index_copy_(1, slot_mapping, key)
            v_cache.index_copy_(1, slot_mapping, value)
            return
        k_scales, v_scales = self.k_scales[layer], self.v_scales[layer]
        assert k_scales is not None and v_scales is not None
        for data, scales, x in ((k_cache, k_scales, key), (v_cache, v_scales, value)):
            q, s = quantize(x)
            data.index_copy_(1, slot_mapping, q)
            scales.index_copy_(1, slot_mapping, s)

    def gather(self, layer: int, block_ids: torch.Tensor, workspace_offset: int = 0):
        """K and V of `block_ids` (flat [n]) as [Hkv, n * block_size, Dk] and [.., Dv], in reused buffers.

        Views stay valid until the next gather that overlaps [workspace_offset, + its size).
        """
        n = block_ids.numel()
        out = []
        for name, pool, scales in (
            ("k", self.k_blocks[layer], self.k_scale_blocks[layer]),
            ("v", self.v_blocks[layer], self.v_scale_blocks[layer]),
        ):
            assert pool is not None, f"layer {layer} has no KV cache"
            heads, row = pool.shape[0], pool.shape[2]  # row: block_size * D
            size = heads * n * row
            view = self._buffer(name, workspace_offset, size).view(heads, n, row)
            if scales is None:
                torch.index_select(pool, 1, block_ids, out=view)
            else:  # int8: gather, widen, then scale each row (q * s is exact in float32 and float64)
                raw = self._buffer("int8", 0, size).view(heads, n, row)
                torch.index_select(pool, 1, block_ids, out=raw)
                view.copy_(raw)
                rows = view.view(heads, n, self.block_size, -1)  # [Hkv, n, block_size, D]
                rows.mul_(torch.index_select(scales, 1, block_ids).to(view.dtype)[..., None])
            out.append(view.view(heads, n * self.block_size, row // self.block_size))
        return out

    def _buffer(self, name: str, offset: int, size: int) -> torch.Tensor:
        """[offset, offset + size) of a reused workspace, grown (doubled) when too small."""
        buf = self._workspace[name]
        if buf.numel() < offset + size:
            buf = self._workspace[name] = torch.empty(2 * (offset + size), dtype=buf.dtype, device=buf.device)
        return buf[offset : offset + size]

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks (swap_out: [(device, host)]), then host blocks to device
        blocks (swap_in: [(host, device)]): a block swapped out may be reused by a swap-in at once."""
        if not swap_out and not swap_in:
            return
        if self.copy_stream is None:  # no CUDA: both pools are host memory, copied in place
            for device_block, host_block, n in _runs(swap_out):
                _copy_run(self.device_pools, self.host_pools, device_block, host_block, n, to_host=True)
            for host_block, device_block, n in _runs(swap_in):
                _copy_run(self.device_pools, self.host_pools, device_block, host_block, n, to_host=False)
            return
        compute = torch.cuda.current_stream(self.device)
        self.copy_stream.wait_stream(compute)  # the forward that wrote these blocks comes first
        with torch.cuda.stream(self.copy_stream):
            staged_out = [self._gather_blocks(pool, [d for d, _ in swap_out]) for pool in self.device_pools]
            for pool, host_pool in zip(self.device_pools, self.host_pools):
                if swap_in:
                    # a staging buffer of the copy stream's own (allocated while it is current)
                    staged_in = torch.empty(
                        (len(swap_in), *host_pool.shape[1:]), dtype=pool.dtype, device=self.device
                    )
                    for (first, n), i in _host_runs([h for h, _ in swap_in]):
                        staged_in[i : i + n].copy_(host_pool[first : first + n], non_blocking=True)
                    _blocks_axis_first(pool)[self._ids([d for _, d in swap_in])] = staged_in
            self._ready = torch.cuda.Event()
            self._ready.record()
            for staged, host_pool in zip(staged_out, self.host_pools):
                if staged is not None:
                    for (first, n), i in _host_runs([h for _, h in swap_out]):
                        host_pool[first : first + n].copy_(staged[i : i + n], non_blocking=True)

    def wait_for_copies(self) -> None:
        """Make the compute stream wait for the device-side part of the swaps issued so far."""
        if self._ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self._ready)
            self._ready = None

    def sync_host(self) -> None:
        """Wait until every copy to host memory issued so far has landed."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()

    def _ids(self, ids: list[int]) -> torch.Tensor:
        """Block ids as a device tensor made on the current (copy) stream."""
        return torch.tensor(ids, dtype=torch.long).pin_memory().to(self.device, non_blocking=True)

    def _gather_blocks(self, pool: torch.Tensor, ids: list[int]) -> torch.Tensor | None:
        """[n, ...one block of every layer of the pool...], contiguous, on the copy stream."""
        if not ids:
            return None
        return _blocks_axis_first(pool)[self._ids(ids)]


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] -> (int8 [..., D], bfloat16 scales [...]) with x ~ q * s per row: s = max|x| / 127
    rounded up to bfloat16 (so |x| / s <= 127), q = x / s rounded to nearest (even). A row of zeros has
    a tiny scale and zeros. Computed in float32 (float64 for a float64 model)."""
    x = x if x.dtype == torch.float64 else x.float()
    absmax = x.abs().amax(dim=-1)
    scales = (absmax * (SCALE_HEADROOM / 127)).clamp_min(1e-30).to(SCALE_DTYPE)
    q = torch.round(x / scales.to(x.dtype)[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def _blocks_axis_first(pool: torch.Tensor) -> torch.Tensor:
    """A device pool viewed with the block axis first, as the host pools are laid out."""
    return pool.movedim(BLOCK_DIM, 0)


def _runs(mapping: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(first source, first destination, n) of each run of consecutive ids on both sides."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in mapping:
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


def _host_runs(host_ids: list[int]) -> list[tuple[tuple[int, int], int]]:
    """((first host block, n), index of its first entry in host_ids) for each run of consecutive ids."""
    runs: list[tuple[tuple[int, int], int]] = []
    for i, block in enumerate(host_ids):
        if runs and sum(runs[-1][0]) == block:
            (first, n), start = runs[-1]
            runs[-1] = ((first, n + 1), start)
        else:
            runs.append(((block, 1), i))
    return runs


def _copy_run(device_pools, host_pools, device_block: int, host_block: int, n: int, *, to_host: bool) -> None:
    """CPU: copy n consecutive blocks between every device pool and its host pool, in place."""
    for device_pool, host_pool in zip(device_pools, host_pools):
        on_device = device_pool.narrow(BLOCK_DIM, device_block, n).movedim(BLOCK_DIM, 0)
        on_host = host_pool.narrow(0, host_block, n)
        if to_host:
            on_host.copy_(on_device)
        else:
            on_device.copy_(on_host)


def _groups(layers: list[LayerGeometry | None]) -> dict[LayerGeometry, list[int]]:
    """Layer indices by geometry, in order of first appearance."""
    groups: dict[LayerGeometry, list[int]] = {}
    for layer, geometry in enumerate(layers):
        if geometry is not None:
            groups.setdefault(geometry, []).append(layer)
    return groups
