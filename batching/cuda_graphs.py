"""CUDA graphs of the whole forward, for decode steps and for steps with prefill chunks alike.

A step of a small model on a GPU is launch-bound: hundreds of kernels of a few microseconds each,
launched one by one from Python (a first H100 run of an 8-layer model: ~2 ms of GPU work in a 12 ms
step). A graph replays them all with one launch. Two families are captured at start-up, each step
replaying the smallest graph it fits, its extra rows padded (model_runner.GraphShape, MetadataPacker):

- decode graphs, for steps of decodes only: batch sizes 1, 2, 4, 8, then every 16 up to max_num_seqs;
  a padded row writes its K/V into the scratch slot and attends over nothing;
- mixed graphs, for steps with prefill chunks, by token count: 32, 64, 128, 256, 384, 512, then every
  512 up to the step budget. A mixed graph has as many segments as a step of its tokens can have (each at
  least a row, at most max_num_seqs) and one more that is always padding, a decode tile per segment, and
  prefill tiles for its tokens plus MAX_CHUNKS chunks' partial tiles: the two attention launches' grids
  are fixed, and padded tiles point at the padding segment, which has no rows and no context. Padded
  rows belong to no segment (their attention output is zeroed) and write the scratch slot.

What a graph reads is one static int64 buffer in MetadataPacker's layout, with every block table padded
to the longest a sequence can have (max_model_len), so that no pointer or shape changes between
replays; a step fills it with one host-to-device copy on the compute stream, which orders the copy
before the replay. The graphs share one memory pool and are replayed one at a time on the compute
stream. A step with more chunks than MAX_CHUNKS, more tokens than the largest graph, or rows that give
log probabilities runs eagerly, as do models whose forward cannot be captured (a host sync inside, such
as a mixture-of-experts layer that counts its tokens): the capture's error is logged once and the engine
runs eagerly.

`capture=False` keeps the same padded steps but runs them eagerly: on a machine without CUDA the suite
checks the padding (under Triton's interpreter) with everything but the capture itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from batching.host_to_device import device_tensor
from batching.model_runner import (
    PREFILL_TILE,
    GraphShape,
    MetadataPacker,
    ModelRunner,
    StepRows,
    fill_pending,
)

log = logging.getLogger(__name__)

MAX_CHUNKS = 4  # prefill chunks a mixed graph's step may hold (one priority class's: usually one or two)


def bucket_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


def token_buckets(max_num_batched_tokens: int) -> list[int]:
    sizes = [b for b in (32, 64, 128, 256, 384, 512) if b < max_num_batched_tokens]
    sizes += list(range(1024, max_num_batched_tokens, 512))
    return sizes + [max_num_batched_tokens]


def decode_shape(size: int) -> GraphShape:
    return GraphShape(rows=size, segments=size, decode_tiles=size)


def mixed_shape(tokens: int, max_num_seqs: int) -> GraphShape:
    segments = min(tokens, max_num_seqs) + 1  # the last: always padding
    return GraphShape(
        rows=tokens,
        segments=segments,
        decode_tiles=segments,
        prefill_tiles=-(-tokens // PREFILL_TILE) + MAX_CHUNKS,
    )


@dataclass(slots=True)
class _Graph:
    shape: GraphShape
    graph: torch.cuda.CUDAGraph | None  # None: replayed eagerly (capture=False)
    buffer: torch.Tensor  # the static metadata the graph reads
    logits: torch.Tensor | None  # [segments, V], written by each replay
    spans: dict
    width: int


class StepGraphs:
    def __init__(
        self,
        runner: ModelRunner,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        max_num_batched_tokens: int | None = None,
        capture: bool = True,
    ):
        assert runner.packer is not None, "graphs run on the Triton path"
        self.runner = runner
        self.packer: MetadataPacker = runner.packer
        self.width = max_blocks_per_seq
        self.capturing = capture
        self.sizes = bucket_sizes(max_num_seqs)
        self.token_sizes = token_buckets(max_num_batched_tokens) if max_num_batched_tokens else []
        self.max_num_seqs = max_num_seqs
        self.graphs: dict[int, _Graph] = {}  # decode graphs by batch size
        self.mixed: dict[int, _Graph] = {}  # mixed graphs by token count
        self.num_replays = 0
        self.num_mixed_replays = 0

    def capture(self) -> bool:
        """Capture every graph, largest first (the pool then fits the smaller ones). False, and nothing
        kept, if the forward cannot be captured."""
        pool = torch.cuda.graph_pool_handle() if self.capturing else None
        try:
            with torch.inference_mode():
                for tokens in reversed(self.token_sizes):
                    self.mixed[tokens] = self._capture(mixed_shape(tokens, self.max_num_seqs), pool)
                for size in reversed(self.sizes):
                    self.graphs[size] = self._capture(decode_shape(size), pool)
        except Exception as exc:  # noqa: BLE001 - whatever the model does, eager still works
            self.graphs.clear()
            self.mixed.clear()
            if self.capturing:
                torch.cuda.synchronize()
            log.warning("CUDA graphs off: the forward cannot be captured (%s: %s)", type(exc).__name__, exc)
            return False
        return True

    def _capture(self, shape: GraphShape, pool) -> _Graph:
        empty = StepRows([], [], [], [], [], [], [], 0)
        host, spans, width, _ = self.packer.layout(empty, self.runner.block_size, shape, width=self.width)
        buffer = self.packer.send(host)  # a padded step: no real row
        if not self.capturing:
            return _Graph(shape, None, buffer, None, spans, width)
        batch = self._views(buffer, spans, width, shape, empty)
        # warm up on a side stream (Triton compiles, the allocator settles), as torch's docs advise
        side = torch.cuda.Stream(self.runner.device)
        side.wait_stream(torch.cuda.current_stream(self.runner.device))
        with torch.cuda.stream(side):
            self.runner.forward(batch)
        torch.cuda.current_stream(self.runner.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self.runner.forward(batch)
        return _Graph(shape, graph, buffer, logits, spans, width)

    def _views(self, buffer, spans, width, shape: GraphShape, rows: StepRows):
        return MetadataPacker.views(
            buffer,
            spans,
            width,
            shape.prefill_tiles,
            rows,
            self.runner.kv_cache,
            self.runner.mask_patterns,
            uncovered_rows=not shape.decode_only,
        )

    @property
    def num_graphs(self) -> int:
        return len(self.graphs) + len(self.mixed)

    def match(self, rows: StepRows) -> Callable[[StepRows], torch.Tensor] | None:
        """The replay for this step, or None when it runs eagerly."""
        n = len(rows.seqs)
        if n == 0:
            return None
        if rows.num_decodes == n:
            if not self.graphs or n > self.sizes[-1]:
                return None
            size = next(s for s in self.sizes if s >= n)
            return lambda rows: self._replay(self.graphs[size], rows)
        tokens = len(rows.input_ids)
        if not self.mixed or n - rows.num_decodes > MAX_CHUNKS or tokens > self.token_sizes[-1]:
            return None
        size = next(s for s in self.token_sizes if s >= tokens)
        return lambda rows: self._replay(self.mixed[size], rows)

    def _replay(self, graph: _Graph, rows: StepRows) -> torch.Tensor:
        host, _, _, _ = self.packer.layout(rows, self.runner.block_size, graph.shape, width=self.width)
        self.packer.send(host, into=graph.buffer)
        fill_pending(graph.buffer[: graph.shape.rows], rows)  # input_ids come first in the buffer
        self.num_replays += 1
        self.num_mixed_replays += not graph.shape.decode_only
        if graph.graph is None:  # not captured: the same padded step, eagerly
            logits = self.runner.forward(
                self._views(graph.buffer, graph.spans, graph.width, graph.shape, rows)
            )
        else:
            graph.graph.replay()
            assert graph.logits is not None  # written by every replay of a captured graph
            logits = graph.logits
        if graph.shape.decode_only:
            return sampled_rows(logits, rows)
        return logits[: len(rows.logits_rows)]  # a mixed graph's first logits rows are the step's


def sampled_rows(logits: torch.Tensor, rows: StepRows) -> torch.Tensor:
    """The rows of a decode graph's logits (one per padded row) that the step samples from, in order."""
    wanted, n = rows.logits_rows, len(rows.seqs)  # a prompt's token fed alone (budget 1) samples nothing
    if len(wanted) == n:  # every decode samples (rows are ascending): the first n rows
        return logits[:n]
    return logits[device_tensor(wanted, logits.device)]
