"""Packs a SchedulerOutput into tensors, runs the block copies, runs the model, returns logits rows.

Streams (CUDA). The forward runs on the compute stream (the current one). Block copies for swaps
run on the KV cache's copy stream (kv_cache.py), and the compute stream waits, with an event, only
for the device-side part of them: the gather of swapped-out blocks (so their blocks may be reused
at once) and the scatter of swapped-in ones (so the forward reads them); the transfers to host
memory overlap the forward. A step's metadata on the Triton path is built in one pinned host buffer
and crosses in one asynchronous copy on the compute stream, which orders it before the kernels that
read it; the buffer is reused once the event recorded after that copy has passed. Steps replay a
CUDA graph of the whole forward (cuda_graphs.py: decode steps by width, steps with prefill chunks by
token count) fed through the same buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter
from typing import Protocol

import numpy as np
import torch

from batching.attention import reset_step, set_step
from batching.attention_metadata import (
    AttentionMetadata,
    DecodeGroup,
    PaddedPrefills,
    PagedSegments,
    TileLaunch,
)
from batching.cpu_attention import PagedAttentionKernel, PrefillTables
from batching.host_to_device import device_tensor
from batching.kv_cache import KVCache
from batching.scheduler import FEW_DECODES, SchedulerOutput  # (fewer decodes: packed in plain Python)
from batching.sequence import Sequence
from batching.state_cache import StateCache
from batching.state_step import build_step

_InferenceMode = torch._C._InferenceMode  # what torch.inference_mode() enters

_computed = attrgetter("num_computed_tokens")
PREFILL_TILE = 16  # queries of one chunk per Triton program (triton_attention.py)
BACKENDS = ("triton", "cpu_kernel", "torch")


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [1, T] every scheduled token, single-query sequences first
    position_ids: torch.Tensor  # [1, T]
    logits_indices: torch.Tensor  # [N] rows whose logits are needed (last token of a finished chunk)
    attn: AttentionMetadata
    sample_seqs: list[Sequence]  # the N sequences that get a new token this step


@dataclass(slots=True)
class StepRows:
    """A step's rows and sequences as plain lists, before any tensor is made. Decodes come first."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    logits_rows: list[int]
    sample_seqs: list[Sequence]
    seqs: list[Sequence]  # one segment each, in row order
    q_lens: list[int]
    num_decodes: int  # the first num_decodes segments have one query each
    # rows whose logits give log probabilities a sequence asked for (a prompt's: Sequence.logprob_positions),
    # and for each such sequence (it, its first such position, their number), in the same order
    logprob_rows: list[int] = field(default_factory=list)
    logprob_spans: list[tuple[Sequence, int, int]] = field(default_factory=list)
    # async scheduling (engine.py): rows whose input token is still on the device, and each one's row in
    # `pending_tokens`, the last step's sampled tokens there
    pending_rows: list[int] = field(default_factory=list)
    pending_sources: list[int] = field(default_factory=list)
    pending_tokens: torch.Tensor | None = None


@dataclass(slots=True)
class _DecodeBatch:
    """A step of decodes only as `ModelRunner._decode_step` packed it, kept for the next one."""

    seqs: list[Sequence]  # the step's sequences, in the scheduler's order (what the next step is compared to)
    order: list[Sequence]  # the same, in row order (longest context first)
    rows: np.ndarray  # [n] each one's row of the block tables (BlockTables)
    positions: np.ndarray  # [n] int64, each one's position this step, in row order
    # [n] int64, the tokens sampled from this step's rows (`ModelRunner.sampled`): the next step's input ids
    tokens: np.ndarray | None = None


@dataclass(slots=True)
class _DecodeViews:
    """A decode step's tensors for one shape (n sequences, tables `width` blocks wide), all views of one int64
    buffer (`ModelRunner._decode_step`'s layout), and the buffer as numpy, which the step's values are written to."""

    shape: tuple[int, int]
    buffer: np.ndarray  # [5 n + n width]
    input_ids: torch.Tensor  # [1, n]
    positions: torch.Tensor  # [1, n]
    slots: torch.Tensor  # [n]
    logits_rows: torch.Tensor  # [n]
    lens: torch.Tensor  # [n] context lengths
    block_ids: torch.Tensor  # [n * width]
    # the step's input over these tensors, made by the first step of this shape and reused by the next ones (its
    # metadata's fields are these views and the runner's constants; the mask cache is emptied each step)
    batch: ModelInput | None = None

    @staticmethod
    def of(n: int, width: int) -> _DecodeViews:
        flat = torch.zeros(5 * n + n * width, dtype=torch.long)
        input_ids, positions, slots, logits_rows, lens, block_ids = flat.split([n, n, n, n, n, n * width])
        return _DecodeViews(
            (n, width),
            flat.numpy(),
            input_ids.view(1, n),
            positions.view(1, n),
            slots,
            logits_rows,
            lens,
            block_ids,
        )


class StepReplays(Protocol):
    """Captured forwards the runner replays instead of running a step eagerly (cuda_graphs.StepGraphs)."""

    def match(self, rows: StepRows) -> Callable[[StepRows], torch.Tensor] | None:
        """The replay that runs this step (returning its logits rows), or None when it runs eagerly."""
        ...


class StepFollowers(Protocol):
    """The other ranks of a tensor-parallel engine (rank_group.RankGroup): each step's swaps and rows reach them
    before rank 0's forward, which they run with it."""

    def send_step(
        self,
        swap_out: list[tuple[int, int]],
        swap_in: list[tuple[int, int]],
        rows: StepRows | None,
        block_tables: np.ndarray | None,
    ) -> None: ...


class ModelRunner:
    def __init__(
        self,
        model,
        kv_cache: KVCache,
        block_size: int,
        device: torch.device,
        attention_kernel: PagedAttentionKernel | None = None,
        mask_patterns: dict | None = None,
        backend: str | None = None,
        state_cache: StateCache | None = None,
    ):
        self.model = model
        self.state_cache = state_cache  # models with state layers (state_layers.py)
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.attention_kernel = attention_kernel  # CPU: attends from the blocks in place (cpu_attention.py)
        self.mask_patterns = mask_patterns or {}  # layer -> windows/chunks only the mask expresses
        self.backend = backend or ("cpu_kernel" if attention_kernel is not None else "torch")
        assert self.backend in BACKENDS, self.backend
        self.block_tables = BlockTables()  # every path's per-step block tables, gathered from it
        self.packer = (
            MetadataPacker(device, kv_cache.scratch_slot, self.block_tables)
            if self.backend == "triton"
            else None
        )
        self.graphs: StepReplays | None = None  # captured by the engine at start-up (cuda_graphs.py)
        self.followers: StepFollowers | None = None  # tensor parallel: the other ranks (set by the engine)
        # the last step, when it was a step of many decodes packed by `_many_decodes` and its forward ran (None
        # otherwise); and the step being packed, until its forward has run
        self._last_decodes: _DecodeBatch | None = None
        self._packed_decodes: _DecodeBatch | None = None
        self._decode_views: _DecodeViews | None = None  # the tensors of `_decode_step`'s last shape

    def execute(
        self, sched: SchedulerOutput, pending_tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, list[Sequence], torch.Tensor | None, list[tuple[Sequence, int, int]]]:
        """Swap blocks, then one packed forward. Returns (logits [N, V] or None, the N sequences, the logits
        of the rows that give asked-for prompt log probabilities [P, V] or None, their spans).
        `pending_tokens`: the last step's sampled tokens on the device, where some of this step's input
        tokens still are (Sequence.pending_row)."""
        # in inference mode, by torch's own guard: `torch.inference_mode()`'s Python wrapper costs ~2 us a step more
        with _InferenceMode(True):
            return self._execute(sched, pending_tokens)

    def _execute(
        self, sched: SchedulerOutput, pending_tokens: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, list[Sequence], torch.Tensor | None, list[tuple[Sequence, int, int]]]:
        last_decodes, self._last_decodes = self._last_decodes, None  # valid for the very next step only
        self._packed_decodes = None
        self.kv_cache.swap(sched.swap_out, sched.swap_in)
        if self.state_cache is not None:
            self.state_cache.swap(sched.state_swap_out, sched.state_swap_in)
        if not sched.seqs:
            if self.followers is not None and (sched.swap_out or sched.swap_in):
                self.followers.send_step(sched.swap_out, sched.swap_in, None, None)
            self.kv_cache.wait_for_copies()
            return None, [], None, []
        if self._decodes_by_columns and pending_tokens is None and sched.num_decodes == len(sched.seqs):
            batch = self._decode_step(sched.seqs, last_decodes)  # the common step on the CPU kernels' path
            self.kv_cache.wait_for_copies()
            logits = self.forward(batch)
            # (kept once the forward has run: the engine then advances each of its sequences by one token)
            self._last_decodes, self._packed_decodes = self._packed_decodes, None
            return logits, batch.sample_seqs, None, []
        rows = self.step_rows(sched, pending=pending_tokens is not None)
        if self.followers is not None:
            self._send_to_followers(sched, rows)
        if rows.pending_rows:
            assert pending_tokens is not None, "an input token on the device, and no tokens given"
            rows.pending_tokens = pending_tokens
        extra = len(rows.logprob_rows)
        if not extra and self.graphs is not None and (replay := self.graphs.match(rows)) is not None:
            self.kv_cache.wait_for_copies()
            return replay(rows), rows.sample_seqs, None, []
        n = len(rows.logits_rows)
        rows.logits_rows += rows.logprob_rows  # one pass of the head over both
        batch = self.prepare(sched, rows)
        fill_pending(batch.input_ids[0], rows)
        self.kv_cache.wait_for_copies()
        logits = self.forward(batch)  # [N + P, V]
        return logits[:n], rows.sample_seqs, logits[n:] if extra else None, rows.logprob_spans

    @property
    def _decodes_by_columns(self) -> bool:
        """Whether a step of decodes only may take `_decode_step`: the CPU kernels' path, one rank, no state
        layers, no captured graphs (each of those reads the step's StepRows)."""
        return (
            self.attention_kernel is not None
            and self.state_cache is None
            and self.followers is None
            and self.graphs is None
        )

    def _decode_step(self, seqs: list[Sequence], last: _DecodeBatch | None = None) -> ModelInput:
        """A step of decodes only (none with its token still on the device), as `prepare(step_rows(...))`
        builds it on the CPU kernels' path, by columns, in one int64 buffer that every tensor of the step views
        (one split): input ids, positions, slots, logits rows, context lengths [n] each, then the block tables
        [n, width] (past a context: anything, never read). Same rows, same order (longest context first, ties
        in the step's order). `last`: the step before, when it was one of these too (`_many_decodes`).

        The tensors are views of one buffer kept from step to step while the step's shape (its sequences and
        table width) stays the same: torch makes no tensor object in the steady state (making 8 cost ~15 us a
        step), and the values are written in place. (The CPU runs each step to its end before the next is
        packed, so nothing reads the last step's values after this; `_decodes_by_columns` is CPU only.)"""
        n = len(seqs)
        flat: np.ndarray | list[int]
        if n < FEW_DECODES:
            seqs, flat, width = self._few_decodes(seqs)
        else:
            seqs, flat, width = self._many_decodes(seqs, last)
        views = self._decode_views
        if views is None or views.shape != (n, width):
            views = self._decode_views = _DecodeViews.of(n, width)
        views.buffer[:] = flat  # every tensor of the last step of this shape views it: their values change
        batch = views.batch
        if batch is not None:
            batch.sample_seqs = seqs
            batch.attn.decodes[0]._masks.clear()  # (built from the context lengths, which changed)
            return batch
        attn = AttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=views.slots,
            decodes=[DecodeGroup(0, n, views.block_ids, views.lens, width)],
            prefills=None,
            attention_kernel=self.attention_kernel,
            mask_patterns=self.mask_patterns,
        )
        views.batch = ModelInput(
            input_ids=views.input_ids,
            position_ids=views.positions,
            logits_indices=views.logits_rows,
            attn=attn,
            sample_seqs=seqs,
        )
        return views.batch

    def _few_decodes(self, seqs: list[Sequence]) -> tuple[list[Sequence], list[int], int]:
        """`_decode_step`'s rows and buffer for a few sequences, from their lists in plain Python (numpy's calls
        and the persistent tables cost more than they save for so few)."""
        bs = self.block_size
        seqs = sorted(seqs, key=_computed, reverse=True)  # (stable)
        positions = list(map(_computed, seqs))
        width = -(-(positions[0] + 1) // bs)
        flat = [seq.token_ids[-1] for seq in seqs]
        flat += positions
        flat += [seq.block_table[p // bs] * bs + p % bs for seq, p in zip(seqs, positions)]
        flat += range(len(seqs))
        flat += [p + 1 for p in positions]
        for seq in seqs:
            table = seq.block_table[:width]
            flat += table
            flat += [0] * (width - len(table))  # past its context: never read
        return seqs, flat, width

    def _many_decodes(
        self, seqs: list[Sequence], last: _DecodeBatch | None
    ) -> tuple[list[Sequence], np.ndarray, int]:
        """`_decode_step`'s rows and buffer by columns in numpy: positions and tokens read in a pass each, the
        slots computed from the persistent block tables (BlockTables), the step's tables one gather from them.

        `last`: the step before, when it was one of these too. If this step decodes the same sequences in the
        same order (the steady state), each of them has computed exactly the one token that step gave it
        (engine.py; a sequence preempted, swapped, aborted or finished since would have left the list, and a
        step of any other kind in between, or one whose forward failed, leaves `last` None): its order, positions
        and table rows are last step's, the positions one further, and only rows that crossed into a new block
        are rewritten."""
        n, bs = len(seqs), self.block_size
        tables = self.block_tables
        if last is not None and last.seqs == seqs:  # (identity, element by element: no Sequence has __eq__)
            seqs, table_rows = last.order, last.rows
            positions = last.positions + 1
            crossed = np.flatnonzero(positions // bs >= tables.filled[table_rows])
            if len(crossed):  # a block every block_size tokens: rewritten from the sequences' lists
                tables.refresh(seqs, table_rows, crossed.tolist())
        else:
            key = list(seqs)  # (a copy: the scheduler's list is not this runner's to keep)
            seqs = sorted(seqs, key=_computed, reverse=True)  # (stable)
            positions = np.array(list(map(_computed, seqs)), np.int64)
            table_rows = np.asarray(tables.rows(seqs), np.int64)
            last = _DecodeBatch(key, seqs, table_rows, positions)
        last.positions = positions
        self._packed_decodes = last
        if last.tokens is not None and len(last.tokens) == n:  # the steady step: what the last step sampled
            input_ids, last.tokens = last.tokens, None
        else:
            input_ids = np.array([seq.token_ids[-1] for seq in seqs], np.int64)
        table = tables.table
        slots = table[table_rows, positions // bs] * bs + positions % bs
        lens = positions + 1
        width = -(-int(lens[0]) // bs)
        # past a context: whatever its row held (block ids of the pool, never read)
        block_ids = table[table_rows, :width].reshape(-1)
        return seqs, np.concatenate([input_ids, positions, slots, np.arange(n), lens, block_ids]), width

    def sampled(self, tokens: torch.Tensor) -> None:
        """The tokens [N] sampled from the rows of the step that just ran (in its sample_seqs' order). After a
        step of many decodes (`_many_decodes`) they are the next step's input ids if it decodes the same
        sequences: each of them then ends with its token (a sequence that stopped would have left the step)."""
        last = self._last_decodes
        if last is not None and tokens.device.type == "cpu":
            last.tokens = tokens.numpy()

    def _send_to_followers(self, sched: SchedulerOutput, rows: StepRows) -> None:
        """The step to the other ranks (tensor parallel), with its sequences' block tables [S, W] gathered from
        the persistent array, W the widest context's blocks."""
        bs = self.block_size
        width = max(-(-(seq.num_computed_tokens + n) // bs) for seq, n in zip(rows.seqs, rows.q_lens))
        assert self.followers is not None
        self.followers.send_step(
            sched.swap_out, sched.swap_in, rows, self.block_tables.gather(rows.seqs, width)
        )

    @torch.inference_mode()
    def follow(
        self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]], rows: StepRows | None
    ) -> None:
        """A tensor-parallel rank's step (rank_group.py): rank 0's swaps on this rank's KV, then the forward of
        rank 0's rows (no logits: rank 0 samples)."""
        self.kv_cache.swap(swap_out, swap_in)
        batch = self._prepare_attention(rows) if rows is not None else None
        self.kv_cache.wait_for_copies()
        if batch is not None:
            self.forward(batch)

    def forward(self, batch: ModelInput) -> torch.Tensor:
        token = set_step(batch.attn)  # for models that do not pass genq_attn on (attention_classes.py)
        try:
            out = self.model(
                input_ids=batch.input_ids,
                position_ids=batch.position_ids,
                logits_to_keep=batch.logits_indices,
                use_cache=False,
                genq_attn=batch.attn,
            )
        finally:
            reset_step(token)
        logits = out.logits[0]
        if logits.shape[0] != batch.logits_indices.shape[0]:  # a model that ignores logits_to_keep (whisper)
            logits = logits[batch.logits_indices]
        return logits  # [N, V]

    def step_rows(self, sched: SchedulerOutput, pending: bool = True) -> StepRows:
        """The step's rows. `pending`: some input tokens may still be on the device (async scheduling:
        Sequence.pending_row); False: none are, and none is looked for."""
        bs = self.block_size
        seqs, counts = sched.seqs, sched.num_scheduled_tokens
        only_decodes = sched.num_decodes == len(seqs)  # the common step
        if only_decodes:
            singles, chunks = list(seqs), []
        else:
            singles = [s for s, n in zip(seqs, counts) if n == 1]
            chunks = [(s, n) for s, n in zip(seqs, counts) if n > 1]
        rows = StepRows([], [], [], [], [], [], [], len(singles))
        # single-query sequences (decodes), longest context first, one token each
        singles.sort(key=_computed, reverse=True)
        positions = list(map(_computed, singles))
        if only_decodes or all(p + 1 == len(seq.token_ids) for seq, p in zip(singles, positions)):
            # every one samples (the common step): the rows in a few comprehensions
            rows.input_ids = [seq.token_ids[-1] for seq in singles]
            rows.positions = positions
            rows.slot_mapping = [seq.block_table[p // bs] * bs + p % bs for seq, p in zip(singles, positions)]
            rows.logits_rows = list(range(len(singles)))
            rows.sample_seqs = list(singles)
            rows.seqs = list(singles)
            rows.q_lens = [1] * len(singles)
            if pending:
                for i, seq in enumerate(singles):
                    if seq.pending_row >= 0:
                        rows.pending_rows.append(i)
                        rows.pending_sources.append(seq.pending_row)
            singles = []
        for seq in singles:
            pos = seq.num_computed_tokens
            if seq.pending_row >= 0 and pos + 1 == seq.num_tokens:
                rows.pending_rows.append(len(rows.input_ids))
                rows.pending_sources.append(seq.pending_row)
            rows.input_ids.append(seq.token_ids[pos])
            rows.positions.append(pos)
            rows.slot_mapping.append(seq.block_table[pos // bs] * bs + pos % bs)
            if pos + 1 == seq.num_tokens:
                rows.logits_rows.append(len(rows.input_ids) - 1)
                rows.sample_seqs.append(seq)
            elif seq.lacks_logprobs:
                self._logprob_rows(rows, seq, len(rows.input_ids) - 1, pos, 1)
            rows.seqs.append(seq)
            rows.q_lens.append(1)
        # prefill chunks: n rows each
        for seq, n in chunks:
            assert seq.pending_row < 0, f"{seq}: a prefill chunk with a token still on the device"
            start, c = len(rows.input_ids), seq.num_computed_tokens
            table = seq.block_table
            rows.input_ids.extend(seq.token_ids[c : c + n])
            rows.positions.extend(range(c, c + n))
            rows.slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(c, c + n))
            if c + n == seq.num_tokens:
                rows.logits_rows.append(start + n - 1)
                rows.sample_seqs.append(seq)
            if seq.lacks_logprobs:
                self._logprob_rows(rows, seq, start, c, n)
            rows.seqs.append(seq)
            rows.q_lens.append(n)
        return rows

    @staticmethod
    def _logprob_rows(rows: StepRows, seq: Sequence, start: int, first: int, n: int) -> None:
        """Add the rows among a segment's (row `start` at position `first`, n rows) that give log
        probabilities `seq` still lacks."""
        wanted = seq.logprob_positions(first, n)
        if wanted:
            rows.logprob_rows.extend(range(start + wanted.start - first, start + wanted.stop - first))
            rows.logprob_spans.append((seq, wanted.start, len(wanted)))

    def prepare(self, sched: SchedulerOutput, rows: StepRows | None = None) -> ModelInput:
        rows = rows or self.step_rows(sched)
        batch = self._prepare_attention(rows)
        if self.state_cache is not None:
            batch.attn.states = build_step(self.state_cache, rows.seqs, rows.q_lens, self.device)
        return batch

    def _prepare_attention(self, rows: StepRows) -> ModelInput:
        if self.packer is not None:
            return self.packer.pack(rows, self.kv_cache, self.block_size, self.mask_patterns)
        # the step's per-row lists in one tensor, viewed as each (one tensor built, not four)
        n = len(rows.input_ids)
        flat = device_tensor(
            rows.input_ids + rows.positions + rows.slot_mapping + rows.logits_rows, self.device
        )
        attn = AttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=flat[2 * n : 3 * n],
            decodes=self._decode_groups(rows),
            prefills=None,
            attention_kernel=self.attention_kernel,
            mask_patterns=self.mask_patterns,
        )
        attn.prefills, attn.prefill_tables = self._prefill_chunks(rows)
        return ModelInput(
            input_ids=flat[:n].view(1, n),
            position_ids=flat[n : 2 * n].view(1, n),
            logits_indices=flat[3 * n :],
            attn=attn,
            sample_seqs=rows.sample_seqs,
        )

    def _decode_groups(self, rows: StepRows) -> list[DecodeGroup]:
        n = rows.num_decodes
        if self.attention_kernel is not None:  # reads each context as it is: one group, no padding
            groups = [(0, n)] if n else []
        else:  # (a single-query segment's row is its own: its position is its computed tokens)
            groups = group_by_length([p + 1 for p in rows.positions[:n]])
        return [self._decode_group(rows, start, end) for start, end in groups]

    def _prefill_chunks(self, rows: StepRows) -> tuple[PaddedPrefills | None, PrefillTables | None]:
        """The step's prompt chunks as the torch path reads them (one padded batch) and, with the CPU
        kernels, as those read them (PrefillTables: one padded table of every chunk's blocks)."""
        bs, first = self.block_size, rows.num_decodes
        seqs, q_lens = rows.seqs[first:], rows.q_lens[first:]
        if not seqs:
            return None, None
        ends = [seq.num_computed_tokens + n for seq, n in zip(seqs, q_lens)]
        width, qmax = max(-(-end // bs) for end in ends), max(q_lens)
        table, row_ids, positions = [], [], []
        start = len(rows.input_ids) - sum(q_lens)  # chunks' rows follow the decodes'
        for seq, n, end in zip(seqs, q_lens, ends):
            blocks = seq.block_table[: -(-end // bs)]
            table.extend(blocks + [0] * (width - len(blocks)))
            row_ids.append(list(range(start, start + n)) + [0] * (qmax - n))
            positions.append(list(range(end - n, end)) + [-1] * (qmax - n))
            start += n
        dev = self.device
        q_pos = torch.tensor(positions, dtype=torch.long, device=dev)
        flat = torch.tensor(table, dtype=torch.long, device=dev)
        padded = PaddedPrefills(
            rows=torch.tensor(row_ids, dtype=torch.long, device=dev),
            valid=q_pos >= 0,
            q_pos=q_pos,
            block_ids=flat,
            width=width,
        )
        if self.attention_kernel is None:
            return padded, None
        starts = [first_row[0] for first_row in row_ids] + [start]
        tables = PrefillTables(
            starts=torch.tensor(starts, dtype=torch.long),
            ctx_lens=torch.tensor(ends, dtype=torch.long),
            block_ids=flat,
            width=width,
        )
        return padded, tables

    def _decode_group(self, rows: StepRows, start: int, end: int) -> DecodeGroup:
        """Single-query segments [start, end) (sorted longest context first)."""
        bs = self.block_size
        lens = [p + 1 for p in rows.positions[start:end]]
        width = -(-lens[0] // bs)
        # past a context: whatever its row held (block ids of the pool, masked or never read)
        tables = torch.from_numpy(self.block_tables.gather(rows.seqs[start:end], width).reshape(-1))
        return DecodeGroup(start, end, tables.to(self.device), device_tensor(lens, self.device), width)


@dataclass(frozen=True, slots=True)
class GraphShape:
    """What a CUDA graph's step is padded to (cuda_graphs.py): its rows, its segments (and as many logits
    rows), and its decode and prefill tiles (the two launches' grids). Decode-only (no prefill tiles):
    every padded row is a decode of its own over nothing. Otherwise the last segment is always padding
    (no rows, no context), and every padded tile points at it."""

    rows: int
    segments: int
    decode_tiles: int
    prefill_tiles: int = 0

    @property
    def decode_only(self) -> bool:
        return self.prefill_tiles == 0


class MetadataPacker:
    """The Triton path's step metadata in one int64 buffer: built in (pinned) host memory, sent in one
    copy, and viewed as every tensor the forward needs.

    Layout: input_ids [T] | positions [T] | slot_mapping [T] | logits rows [N] | q_start [S] | q_len [S]
    | ctx_len [S] | decode tiles' segment [D] and offset [D] | prefill tiles' segment [P] and offset [P]
    | block table [S, W]. With a `GraphShape` (a CUDA graph's), the step is padded to it with rows that
    write to the scratch slot and attend over nothing.
    """

    def __init__(self, device: torch.device, scratch_slot: int, block_tables: BlockTables | None = None):
        self.device = device
        self.scratch_slot = scratch_slot  # a KV slot no sequence owns: padded rows write there
        self.pinned = device.type == "cuda"
        self._staging = torch.empty(0, dtype=torch.long)
        self._sent: torch.cuda.Event | None = None  # the last copy out of _staging
        self.block_tables = block_tables if block_tables is not None else BlockTables()

    def layout(
        self, rows: StepRows, block_size: int, shape: GraphShape | None = None, width: int | None = None
    ):
        """(host buffer as numpy, {name: (offset, length)}, table width, prefill tiles) for the step."""
        n_rows, n_logits, n_segs = len(rows.input_ids), len(rows.logits_rows), len(rows.seqs)
        tiles = [
            (s, off)
            for s in range(rows.num_decodes, len(rows.seqs))
            for off in range(0, rows.q_lens[s], PREFILL_TILE)
        ]
        n_dec, n_pre = rows.num_decodes, len(tiles)
        if shape is not None:
            assert n_rows <= shape.rows and n_segs <= shape.segments - (not shape.decode_only), (rows, shape)
            assert n_dec <= shape.decode_tiles and n_pre <= shape.prefill_tiles, (rows, shape)
            n_rows, n_logits = shape.rows, shape.segments
            n_segs, n_dec, n_pre = shape.segments, shape.decode_tiles, shape.prefill_tiles
        contexts = [seq.num_computed_tokens + n for seq, n in zip(rows.seqs, rows.q_lens)]
        if width is None:
            width = max(-(-c // block_size) for c in contexts)
        sizes = dict(
            input_ids=n_rows,
            positions=n_rows,
            slot_mapping=n_rows,
            logits_rows=n_logits,
            q_start=n_segs,
            q_len=n_segs,
            ctx_len=n_segs,
            decode_seg=n_dec,
            decode_off=n_dec,
            prefill_seg=n_pre,
            prefill_off=n_pre,
            block_table=n_segs * width,
        )
        spans, offset = {}, 0
        for name, size in sizes.items():
            spans[name] = (offset, size)
            offset += size + size % 2  # every tensor 16-byte aligned: Triton compiles per alignment
        buf = self._host_buffer(offset)
        view = {name: buf[o : o + n] for name, (o, n) in spans.items()}
        q_starts = np.cumsum([0, *rows.q_lens[:-1]]) if rows.seqs else np.zeros(0, np.int64)
        for name, values in (
            ("input_ids", rows.input_ids),
            ("positions", rows.positions),
            ("slot_mapping", rows.slot_mapping),
            ("logits_rows", rows.logits_rows),
            ("q_start", q_starts),
            ("q_len", rows.q_lens),
            ("ctx_len", contexts),
            ("decode_seg", range(rows.num_decodes)),
            ("prefill_seg", [s for s, _ in tiles]),
            ("prefill_off", [off for _, off in tiles]),
        ):
            view[name][: len(values)] = values
        view["decode_off"][:] = 0
        if rows.seqs:  # (a graph's padded rows keep what they held: never read, with no context)
            view["block_table"][: len(rows.seqs) * width] = self.block_tables.gather(
                rows.seqs, width
            ).reshape(-1)
        if shape is not None:
            self._pad(view, rows, shape, len(tiles))
        return buf[:offset], spans, width, n_pre

    def _pad(self, view: dict, rows: StepRows, shape: GraphShape, num_tiles: int) -> None:
        """Rows past the step's: no token, the scratch slot, no context. Decode-only: each padded row is a
        segment of its own; mixed: padded segments have no rows, and padded tiles point at the last."""
        real, segs = len(rows.input_ids), len(rows.seqs)
        view["input_ids"][real:] = 0
        view["positions"][real:] = 0
        view["slot_mapping"][real:] = self.scratch_slot
        if shape.decode_only:
            view["logits_rows"][:] = np.arange(shape.rows)  # a graph computes every row's logits
            view["q_start"][real:] = np.arange(real, shape.rows)
            view["q_len"][real:] = 1
            view["ctx_len"][real:] = 0
            view["decode_seg"][real:] = np.arange(real, shape.rows)
            return
        pad_segment = shape.segments - 1
        view["logits_rows"][len(rows.logits_rows) :] = 0  # the first rows' logits are the step's
        view["q_start"][segs:] = 0
        view["q_len"][segs:] = 0
        view["ctx_len"][segs:] = 0
        view["decode_seg"][rows.num_decodes :] = pad_segment
        view["prefill_seg"][num_tiles:] = pad_segment
        view["prefill_off"][num_tiles:] = 0

    def _host_buffer(self, size: int) -> np.ndarray:
        if self._sent is not None:
            self._sent.synchronize()  # the last step's copy has left the buffer
            self._sent = None
        if self._staging.numel() < size:
            self._staging = torch.empty(
                max(size, 2 * self._staging.numel()), dtype=torch.long, pin_memory=self.pinned
            )
        return self._staging.numpy()

    def send(self, host: np.ndarray, into: torch.Tensor | None = None) -> torch.Tensor:
        """One copy of the host buffer to the device (into `into` if given); the step's tensors view it."""
        src = self._staging[: len(host)]
        if self.device.type == "cpu":
            return src.clone() if into is None else into.copy_(src)
        dst = into if into is not None else torch.empty(len(host), dtype=torch.long, device=self.device)
        dst.copy_(src, non_blocking=True)
        self._sent = torch.cuda.Event()
        self._sent.record()
        return dst

    def pack(self, rows: StepRows, kv_cache: KVCache, block_size: int, mask_patterns: dict) -> ModelInput:
        host, spans, width, num_prefill_tiles = self.layout(rows, block_size)
        return self.views(self.send(host), spans, width, num_prefill_tiles, rows, kv_cache, mask_patterns)

    @staticmethod
    def views(
        dev: torch.Tensor,
        spans: dict,
        width: int,
        num_prefill_tiles: int,
        rows: StepRows,
        kv_cache,
        mask_patterns,
        uncovered_rows: bool = False,
    ) -> ModelInput:
        v = {name: dev[o : o + n] for name, (o, n) in spans.items()}
        n_dec = spans["decode_seg"][1]
        segments = PagedSegments(
            uncovered_rows=uncovered_rows,
            q_start=v["q_start"],
            q_len=v["q_len"],
            ctx_len=v["ctx_len"],
            block_table=v["block_table"].view(-1, width),
            decode=TileLaunch(v["decode_seg"], v["decode_off"], 1, n_dec) if n_dec else None,
            prefill=(
                TileLaunch(v["prefill_seg"], v["prefill_off"], PREFILL_TILE, num_prefill_tiles)
                if num_prefill_tiles
                else None
            ),
        )
        attn = AttentionMetadata(
            kv_cache=kv_cache,
            slot_mapping=v["slot_mapping"],
            decodes=[],
            prefills=None,
            mask_patterns=mask_patterns,
            segments=segments,
        )
        return ModelInput(
            input_ids=v["input_ids"].view(1, -1),
            position_ids=v["positions"].view(1, -1),
            logits_indices=v["logits_rows"],
            attn=attn,
            sample_seqs=rows.sample_seqs,
        )


class BlockTables:
    """Each sequence's block table as a row of one persistent array, written as the table grows (a block
    every block_size tokens), not rebuilt from the lists every step: a step's tables are one gather of
    its sequences' rows. A row is rewritten whole when its sequence's list is a new one (swapped in,
    preempted, started on a cached prefix); rows of sequences that left are reused when room runs out."""

    def __init__(self):
        self.table = np.zeros((0, 0), np.int64)
        self.row_of: dict[Sequence, int] = {}
        self.source: list[list[int] | None] = []  # the list each row was written from (kept alive)
        self.source_id = np.zeros(0, np.int64)  # id() of each, 0 for none
        self.filled = np.zeros(0, np.int64)  # entries written from it
        self.free: list[int] = []

    def gather(self, seqs: list[Sequence], width: int) -> np.ndarray:
        """[len(seqs), width]: each sequence's blocks (past its table: whatever the row held)."""
        rows = self.rows(seqs, width)
        return self.table[rows, :width]

    def rows(self, seqs: list[Sequence], width: int = 0) -> np.ndarray | list[int]:
        """Each sequence's row of `table`, written up to date, the table at least `width` wide.

        The check that a row is up to date (its sequence has one, written from the same list, as long as
        it is) runs in numpy over the rows; only rows that are not go through Python (a block every
        block_size tokens, a new list)."""
        n = len(seqs)
        tables = list(map(_block_table, seqs))
        longest = max(map(len, tables), default=0)
        if max(longest, width) > self.table.shape[1]:
            self._grow(self.table.shape[0], max(longest, width, 2 * self.table.shape[1]))
        if n < FEW_DECODES:  # a few rows: numpy's calls cost more than checking them one by one
            return [self._update(seq, seqs) for seq in seqs]  # (first: taking a row may grow the table)
        lens = np.fromiter(map(len, tables), np.int64, n)
        rows = np.fromiter(map(self.row_of.get, seqs, repeat(-1)), np.int64, n)
        if self.table.shape[0]:
            ids = np.fromiter(map(id, tables), np.int64, n)
            stale = np.flatnonzero((rows < 0) | (self.source_id[rows] != ids) | (self.filled[rows] != lens))
        else:
            stale = np.arange(n)
        for i in stale.tolist():
            rows[i] = self._update(seqs[i], seqs)
        return rows

    def refresh(self, seqs: list[Sequence], rows: np.ndarray, which: list[int]) -> None:
        """Rewrite the rows of `seqs[i]` for i in `which` (they hold rows `rows[i]` already) from their lists,
        the table widened first if a list outgrew it."""
        longest = max(len(seqs[i].block_table) for i in which)
        if longest > self.table.shape[1]:
            self._grow(self.table.shape[0], max(longest, 2 * self.table.shape[1]))
        source = self.source
        at = rows[which]  # [k] their rows
        written = self.filled[at].tolist()
        grown: list[int] = []  # of `which`, those whose list grew by one block since its row was written
        new: list[int] = []  # that block
        for i, r, n in zip(which, at.tolist(), written):
            blocks = seqs[i].block_table
            if source[r] is blocks and len(blocks) == n + 1:  # (the common case: a block more)
                grown.append(r)
                new.append(blocks[n])
            else:
                rows[i] = self._update(seqs[i], seqs)
        if grown:
            self.table[grown, self.filled[grown]] = new
            self.filled[grown] += 1

    def _update(self, seq: Sequence, seqs: list[Sequence]) -> int:
        """`seq`'s row, taken if it has none, and written where it is not up to date."""
        r = self.row_of.get(seq)
        if r is None:
            r = self.row_of[seq] = self._take_row(seqs)
        blocks, filled = seq.block_table, int(self.filled[r])
        if self.source[r] is not blocks:
            self.table[r, : len(blocks)] = blocks
            self.source[r], self.source_id[r], self.filled[r] = blocks, id(blocks), len(blocks)
        elif len(blocks) > filled:
            self.table[r, filled : len(blocks)] = blocks[filled:]
            self.filled[r] = len(blocks)
        return r

    def _take_row(self, seqs: list[Sequence]) -> int:
        if not self.free:
            stepping = set(seqs)
            for seq in [s for s in self.row_of if s not in stepping]:
                self.free.append(self.row_of.pop(seq))
                self.source[self.free[-1]] = None
                self.source_id[self.free[-1]] = 0
        if not self.free:
            n = self.table.shape[0]
            self._grow(max(64, 2 * n), self.table.shape[1])
            self.free.extend(range(self.table.shape[0] - 1, n - 1, -1))
        return self.free.pop()

    def _grow(self, rows: int, cols: int) -> None:
        grown = np.zeros((rows, cols), np.int64)
        grown[: self.table.shape[0], : self.table.shape[1]] = self.table
        self.table = grown
        extra = rows - len(self.source)
        self.source += [None] * extra
        self.source_id = np.concatenate([self.source_id, np.zeros(extra, np.int64)])
        self.filled = np.concatenate([self.filled, np.zeros(extra, np.int64)])


_block_table = attrgetter("block_table")


def fill_pending(input_ids: torch.Tensor, rows: StepRows) -> None:
    """Write into `input_ids` [T] (the step's, on the device) the tokens its rows take from the last step's
    sampled tokens (async scheduling): one gather and one scatter on the device, no wait for it."""
    if not rows.pending_rows:
        return
    assert rows.pending_tokens is not None
    dev = input_ids.device
    at, src = device_tensor(rows.pending_rows, dev), device_tensor(rows.pending_sources, dev)
    input_ids.index_copy_(0, at, rows.pending_tokens.index_select(0, src))


MIN_GROUP = 8  # fewer rows than this are not worth a call of their own
MAX_GROUPS = 4
SPLIT_RATIO = 0.6  # start a new group when a context is this much shorter than the group's longest


def group_by_length(lengths: list[int]) -> list[tuple[int, int]]:
    """Split lengths (sorted longest first) into [start, end) groups that waste little padding."""
    groups: list[tuple[int, int]] = []
    start = 0
    for i, length in enumerate(lengths):
        if i - start >= MIN_GROUP and len(groups) < MAX_GROUPS - 1 and length < SPLIT_RATIO * lengths[start]:
            groups.append((start, i))
            start = i
    if lengths:
        groups.append((start, len(lengths)))
    return groups
