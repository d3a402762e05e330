"""What one step tells the attention layers: where each row's K/V goes and what each row attends.

The runner (model_runner.py) builds one AttentionMetadata per step for the attention path in use:

- Triton (CUDA; triton_attention.py): `segments`, every sequence's rows, context length and block
  table, and the query tiles of at most two launches. Device tensors, all views of one buffer that
  crossed from the host in one copy.
- the CPU kernels (cpu_attention.py): one decode group over every decode, and `prefill_tables`.
- torch (attention.py; the fallback on either device): decodes in a few groups of similar context
  length, the prefill chunks as one padded batch; each group gathers its contexts in one call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batching.cpu_attention import PagedAttentionKernel, PrefillTables
from batching.kv_cache import KVCache
from batching.state_step import StateStep


@dataclass(slots=True)
class TileLaunch:
    """One kernel launch's query tiles: tile i holds queries [q_off, q_off + block_q) of segment seg."""

    tile_seg: torch.Tensor  # [P] int64, the segment of each tile
    tile_q_off: torch.Tensor  # [P] int64, its first query within the segment
    block_q: int  # queries per tile: 1 for decodes
    num_tiles: int  # P, the grid's first axis


@dataclass(slots=True)
class PagedSegments:
    """A step's sequences as the Triton kernel reads them (int64 device tensors)."""

    q_start: torch.Tensor  # [S] the segment's first row in the packed batch
    q_len: torch.Tensor  # [S] its rows this step (1 for a decode)
    ctx_len: torch.Tensor  # [S] tokens it attends over: cached + this step's
    block_table: torch.Tensor  # [S, W] device block ids, padded with anything (never read past ctx_len)
    decode: TileLaunch | None  # one query per tile
    prefill: TileLaunch | None  # PREFILL_TILE queries per tile
    uncovered_rows: bool = False  # rows past the segments' (a graph's padding): their output is zeroed


@dataclass(slots=True)
class PaddedPrefills:
    """The step's prompt chunks for the torch path, as one padded batch: C chunks of at most qmax
    queries, each attending over its context through a block table padded to `width` blocks."""

    rows: torch.Tensor  # [C, qmax] the packed row of each chunk's j-th query (0 past the chunk's end)
    valid: torch.Tensor  # [C, qmax] bool: a real query
    q_pos: torch.Tensor  # [C, qmax] each query's position in its sequence
    block_ids: torch.Tensor  # [C * width] the chunks' block tables, padded
    width: int


@dataclass(slots=True)
class DecodeGroup:
    """Single-query sequences of similar context length, attended in one batched call."""

    start: int  # rows [start, end) of the packed batch, one per sequence
    end: int
    block_ids: torch.Tensor  # [n * width] block tables, padded to `width` blocks, flattened
    context_lens: torch.Tensor  # [n]
    width: int  # blocks per sequence after padding
    _masks: dict = field(default_factory=dict)  # by sliding window, built once per step

    def mask(self, sliding_window: int | None, block_size: int, chunk: int | None = None) -> torch.Tensor:
        """[1, n, 1, width * block_size] bool, True where the query may attend."""
        mask = self._masks.get((sliding_window, chunk))
        if mask is None:
            lens = self.context_lens[:, None]
            pos = torch.arange(self.width * block_size, device=lens.device)[None, :]
            mask = pos < lens
            if sliding_window is not None:
                mask &= pos > lens - 1 - sliding_window
            if chunk is not None:  # the query (at lens - 1) sees its own chunk only
                mask &= pos >= (lens - 1) // chunk * chunk
            mask = self._masks[(sliding_window, chunk)] = mask[None, :, None, :]
        return mask


@dataclass(slots=True)
class AttentionMetadata:
    kv_cache: KVCache
    slot_mapping: torch.Tensor  # [T] cache slot of every packed token
    decodes: list[DecodeGroup]  # single-query rows come first in the packed batch
    prefills: PaddedPrefills | None  # the torch path's view of the prompt chunks
    attention_kernel: PagedAttentionKernel | None = (
        None  # attends from the blocks in place (CPU); None: torch
    )
    prefill_tables: PrefillTables | None = None  # the prefill chunks as the CPU kernel reads them
    mask_patterns: dict = field(default_factory=dict)  # layer -> MaskPattern: windows/chunks of the mask only
    segments: PagedSegments | None = None  # the Triton kernel's view of the step (CUDA); None: other paths
    states: StateStep | None = (
        None  # the state layers' view of the step (state_layers.py); None: no such layers
    )
