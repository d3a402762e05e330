"""Packs a SchedulerOutput into tensors, runs the block copies, runs the model, returns logits rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batching.attention import AttentionMetadata, PrefillChunk
from batching.kv_cache import KVCache
from batching.scheduler import SchedulerOutput
from batching.sequence import Sequence


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor        # [1, T] every scheduled token, single-query sequences first
    position_ids: torch.Tensor     # [1, T]
    logits_indices: torch.Tensor   # [N] rows whose logits are needed (last token of a finished chunk)
    attn: AttentionMetadata
    sample_seqs: list[Sequence]    # the N sequences that get a new token this step


class ModelRunner:
    def __init__(self, model, kv_cache: KVCache, block_size: int, device: torch.device):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> tuple[torch.Tensor | None, list[Sequence]]:
        """Swap blocks, then one packed forward. Returns (logits [N, V] or None, the N sequences)."""
        self.kv_cache.swap_out(sched.swap_out)   # before swap_in: freed blocks may be reused at once
        self.kv_cache.swap_in(sched.swap_in)
        if not sched.seqs:
            self.kv_cache.wait_for_copies()
            return None, []
        batch = self.prepare(sched)
        self.kv_cache.wait_for_copies()
        out = self.model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                         logits_to_keep=batch.logits_indices, use_cache=False, genq_attn=batch.attn)
        return out.logits[0], batch.sample_seqs                           # [N, V]

    def prepare(self, sched: SchedulerOutput) -> ModelInput:
        bs = self.block_size
        singles = [(s, n) for s, n in zip(sched.seqs, sched.num_scheduled_tokens) if n == 1]
        chunks = [(s, n) for s, n in zip(sched.seqs, sched.num_scheduled_tokens) if n > 1]

        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        logits_rows: list[int] = []
        sample_seqs: list[Sequence] = []

        # single-query sequences (decodes): one token each, attended in one batched call
        for seq, _ in singles:
            pos = seq.num_computed_tokens
            input_ids.append(seq.token_ids[pos])
            positions.append(pos)
            slot_mapping.append(seq.block_table[pos // bs] * bs + pos % bs)
            if pos + 1 == seq.num_tokens:
                logits_rows.append(len(input_ids) - 1)
                sample_seqs.append(seq)
        decode_slots = decode_lens = None
        if singles:
            lens = [s.num_computed_tokens + 1 for s, _ in singles]
            decode_slots = self._context_slots([s.block_table for s, _ in singles], max(lens))  # [Nd, Lmax]
            decode_lens = torch.tensor(lens, device=self.device)

        # prefill chunks: rows [start, end) each
        prefills: list[PrefillChunk] = []
        for seq, n in chunks:
            start, c = len(input_ids), seq.num_computed_tokens
            input_ids.extend(seq.token_ids[c:c + n])
            positions.extend(range(c, c + n))
            chunk_slots = self._context_slots([seq.block_table], c + n)[0]      # [c + n]
            slot_mapping.extend(chunk_slots[c:].tolist())
            prefills.append(PrefillChunk(start, start + n, c + n, chunk_slots if c else None))
            if c + n == seq.num_tokens:
                logits_rows.append(start + n - 1)
                sample_seqs.append(seq)

        attn = AttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=self.device),
            num_decodes=len(singles), decode_slots=decode_slots, decode_context_lens=decode_lens,
            prefills=prefills,
        )
        return ModelInput(
            input_ids=torch.tensor([input_ids], device=self.device),
            position_ids=torch.tensor([positions], device=self.device),
            logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=self.device),
            attn=attn, sample_seqs=sample_seqs,
        )

    def _context_slots(self, block_tables: list[list[int]], length: int) -> torch.Tensor:
        """[B, length] cache slot of each position 0..length-1 (padding rows point at slot 0)."""
        bs = self.block_size
        width = -(-length // bs)
        table = torch.tensor([bt[:width] + [0] * (width - len(bt[:width])) for bt in block_tables],
                             device=self.device)                              # [B, width]
        pos = torch.arange(length, device=self.device)
        return table[:, pos // bs] * bs + pos % bs
