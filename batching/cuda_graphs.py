"""CUDA graphs of the whole forward for decode-only steps, one per batch-size bucket.

A decode step of a small model on a GPU is launch-bound: hundreds of kernels of a few microseconds
each, launched one by one from Python (a first H100 run of an 8-layer model: ~2 ms of GPU work in a
12 ms step). A graph replays them all with one launch. Graphs are captured at start-up for batch
sizes 1, 2, 4, 8, then every 16 up to max_num_seqs (and max_num_seqs itself); a step of n decodes
replays the smallest graph of at least n rows, its extra rows padded: they write their K/V into the
scratch block and attend over nothing (model_runner.MetadataPacker).

What a graph reads is one static int64 buffer per bucket in MetadataPacker's layout, with every
block table padded to the longest a sequence can have (max_model_len), so that no pointer or shape
changes between replays; a step fills it with one host-to-device copy on the compute stream, which
orders the copy before the replay. The graphs share one memory pool and are replayed one at a time
on the compute stream. Steps with a prefill chunk, or more decodes than the largest bucket, run
eagerly, as do models whose forward cannot be captured (a host sync inside, such as a
mixture-of-experts layer that counts its tokens): the capture's error is logged once and the
engine runs eagerly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from batching.host_to_device import device_tensor
from batching.model_runner import MetadataPacker, ModelRunner, StepRows, fill_pending

log = logging.getLogger(__name__)


def bucket_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


@dataclass(slots=True)
class _Graph:
    size: int  # rows
    graph: torch.cuda.CUDAGraph
    buffer: torch.Tensor  # the static metadata the graph reads
    logits: torch.Tensor  # [size, V], written by each replay


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, max_num_seqs: int, max_blocks_per_seq: int):
        assert runner.packer is not None, "graphs run on the Triton path"
        self.runner = runner
        self.packer: MetadataPacker = runner.packer
        self.width = max_blocks_per_seq
        self.sizes = bucket_sizes(max_num_seqs)
        self.graphs: dict[int, _Graph] = {}
        self.num_replays = 0

    def capture(self) -> bool:
        """Capture every bucket, largest first (the pool then fits the smaller ones). False, and
        nothing kept, if the forward cannot be captured."""
        pool = torch.cuda.graph_pool_handle()
        try:
            with torch.inference_mode():
                for size in reversed(self.sizes):
                    self.graphs[size] = self._capture(size, pool)
        except Exception as exc:  # noqa: BLE001 - whatever the model does, eager still works
            self.graphs.clear()
            torch.cuda.synchronize()
            log.warning("CUDA graphs off: the forward cannot be captured (%s: %s)", type(exc).__name__, exc)
            return False
        return True

    def _capture(self, size: int, pool) -> _Graph:
        empty = StepRows([], [], [], [], [], [], [], 0)
        host, spans, width, _ = self.packer.layout(
            empty, self.runner.block_size, pad_to=size, width=self.width
        )
        buffer = self.packer.send(host)  # a padded step: no real row
        batch = MetadataPacker.views(
            buffer, spans, width, 0, empty, self.runner.kv_cache, self.runner.mask_patterns
        )
        # warm up on a side stream (Triton compiles, the allocator settles), as torch's docs advise
        side = torch.cuda.Stream(self.runner.device)
        side.wait_stream(torch.cuda.current_stream(self.runner.device))
        with torch.cuda.stream(side):
            self.runner.forward(batch)
        torch.cuda.current_stream(self.runner.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self.runner.forward(batch)
        return _Graph(size, graph, buffer, logits)

    def match(self, rows: StepRows):
        """The replay for this step, or None when it runs eagerly."""
        n = len(rows.seqs)
        if not self.graphs or n == 0 or rows.num_decodes != n or n > self.sizes[-1]:
            return None
        size = next(s for s in self.sizes if s >= n)
        return lambda rows: self._replay(self.graphs[size], rows)

    def _replay(self, graph: _Graph, rows: StepRows) -> torch.Tensor:
        host, _, _, _ = self.packer.layout(rows, self.runner.block_size, pad_to=graph.size, width=self.width)
        self.packer.send(host, into=graph.buffer)
        fill_pending(graph.buffer[: graph.size], rows)  # input_ids come first in the buffer
        graph.graph.replay()
        self.num_replays += 1
        return sampled_rows(graph.logits, rows)


def sampled_rows(logits: torch.Tensor, rows: StepRows) -> torch.Tensor:
    """The rows of a graph's logits (one per padded row) that the step samples from, in order."""
    wanted, n = rows.logits_rows, len(rows.seqs)  # a prompt's token fed alone (budget 1) samples nothing
    if len(wanted) == n:  # every decode samples (rows are ascending): the first n rows
        return logits[:n]
    return logits[device_tensor(wanted, logits.device)]
