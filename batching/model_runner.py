"""Packs a SchedulerOutput into tensors, runs the block copies, runs the model, returns logits rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batching.attention import AttentionMetadata, DecodeGroup, PrefillChunk, step_context
from batching.cpu_attention import PagedAttentionKernel, PrefillTables
from batching.kv_cache import KVCache
from batching.scheduler import SchedulerOutput
from batching.sequence import Sequence


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [1, T] every scheduled token, single-query sequences first
    position_ids: torch.Tensor  # [1, T]
    logits_indices: torch.Tensor  # [N] rows whose logits are needed (last token of a finished chunk)
    attn: AttentionMetadata
    sample_seqs: list[Sequence]  # the N sequences that get a new token this step


class ModelRunner:
    def __init__(
        self,
        model,
        kv_cache: KVCache,
        block_size: int,
        device: torch.device,
        attention_kernel: PagedAttentionKernel | None = None,
        mask_patterns: dict | None = None,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.attention_kernel = attention_kernel  # CPU: attends from the blocks in place (cpu_attention.py)
        self.mask_patterns = mask_patterns or {}  # layer -> windows/chunks only the mask expresses

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[torch.Tensor | None, list[Sequence]]:
        """Swap blocks, then one packed forward. Returns (logits [N, V] or None, the N sequences)."""
        self.kv_cache.swap_out(sched.swap_out)  # before swap_in: freed blocks may be reused at once
        self.kv_cache.swap_in(sched.swap_in)
        if not sched.seqs:
            self.kv_cache.wait_for_copies()
            return None, []
        batch = self.prepare(sched)
        self.kv_cache.wait_for_copies()
        with step_context(batch.attn):  # for models that do not pass genq_attn on (attention_classes.py)
            out = self.model(
                input_ids=batch.input_ids,
                position_ids=batch.position_ids,
                logits_to_keep=batch.logits_indices,
                use_cache=False,
                genq_attn=batch.attn,
            )
        return out.logits[0], batch.sample_seqs  # [N, V]

    def prepare(self, sched: SchedulerOutput) -> ModelInput:
        bs = self.block_size
        singles = [(s, n) for s, n in zip(sched.seqs, sched.num_scheduled_tokens) if n == 1]
        chunks = [(s, n) for s, n in zip(sched.seqs, sched.num_scheduled_tokens) if n > 1]

        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        logits_rows: list[int] = []
        sample_seqs: list[Sequence] = []

        # single-query sequences (decodes), longest context first, one token each
        singles.sort(key=lambda item: item[0].num_computed_tokens, reverse=True)
        for seq, _ in singles:
            pos = seq.num_computed_tokens
            input_ids.append(seq.token_ids[pos])
            positions.append(pos)
            slot_mapping.append(seq.block_table[pos // bs] * bs + pos % bs)
            if pos + 1 == seq.num_tokens:
                logits_rows.append(len(input_ids) - 1)
                sample_seqs.append(seq)
        if self.attention_kernel is not None:  # reads each context as it is: one group, no padding
            groups = [(0, len(singles))] if singles else []
        else:
            groups = group_by_length([s.num_computed_tokens + 1 for s, _ in singles])
        decodes = [self._decode_group(singles, start, end) for start, end in groups]

        # prefill chunks: rows [start, end) each
        prefills: list[PrefillChunk] = []
        chunk_tables: list[list[int]] = []  # each chunk's blocks, up to its last token
        for seq, n in chunks:
            start, c = len(input_ids), seq.num_computed_tokens
            input_ids.extend(seq.token_ids[c : c + n])
            positions.extend(range(c, c + n))
            table = seq.block_table
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(c, c + n))
            chunk_tables.append(table[: -(-(c + n) // bs)])
            prefills.append(PrefillChunk(start, start + n, c + n, None))
            if c + n == seq.num_tokens:
                logits_rows.append(start + n - 1)
                sample_seqs.append(seq)
        prefill_tables = self._attach_block_ids(prefills, chunk_tables)

        attn = AttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=self.device),
            decodes=decodes,
            prefills=prefills,
            attention_kernel=self.attention_kernel,
            prefill_tables=prefill_tables,
            mask_patterns=self.mask_patterns,
        )
        return ModelInput(
            input_ids=torch.tensor([input_ids], device=self.device),
            position_ids=torch.tensor([positions], device=self.device),
            logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=self.device),
            attn=attn,
            sample_seqs=sample_seqs,
        )

    def _attach_block_ids(
        self, prefills: list[PrefillChunk], tables: list[list[int]]
    ) -> PrefillTables | None:
        """Give each chunk with cached context its block ids (the torch path gathers them). With the
        CPU kernel, all chunks' tables go in one padded tensor, which the kernel reads in one call
        and the chunks take views of; else one tensor per chunk."""
        if self.attention_kernel is None or not prefills:
            for prefill, table in zip(prefills, tables):
                if prefill.context_len > prefill.end - prefill.start:
                    prefill.block_ids = torch.tensor(table, dtype=torch.long, device=self.device)
            return None
        width = max(len(t) for t in tables)
        flat = torch.tensor([block for t in tables for block in t + [0] * (width - len(t))], dtype=torch.long)
        for i, (prefill, table) in enumerate(zip(prefills, tables)):
            if prefill.context_len > prefill.end - prefill.start:
                prefill.block_ids = flat[i * width : i * width + len(table)]
        return PrefillTables(
            starts=torch.tensor([p.start for p in prefills] + [prefills[-1].end], dtype=torch.long),
            ctx_lens=torch.tensor([p.context_len for p in prefills], dtype=torch.long),
            block_ids=flat,
            width=width,
        )

    def _decode_group(self, singles: list[tuple[Sequence, int]], start: int, end: int) -> DecodeGroup:
        bs = self.block_size
        lens = [seq.num_computed_tokens + 1 for seq, _ in singles[start:end]]
        width = -(-max(lens) // bs)
        padded: list[int] = []
        for seq, _ in singles[start:end]:
            table = seq.block_table[:width]
            padded.extend(table)
            padded.extend([0] * (width - len(table)))
        return DecodeGroup(
            start,
            end,
            torch.tensor(padded, dtype=torch.long, device=self.device),
            torch.tensor(lens, device=self.device),
            width,
        )


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
