"""What the penalties need of each penalized sequence's tokens, kept on the sampler's device: which tokens
it has seen (prompt and output) and how often each came in its output. A sequence's row is built from its
tokens once, the first step it is penalized, then updated with the ids each step samples for it (one
scatter for all rows, from the sampled tokens already on the device): a step costs no walk over the
sequences' tokens on the CPU, whatever their length. A row goes when its sequence ends (`forget`).

A row knows how many of its sequence's tokens it counts; one that does not match what the sequence holds
(its sampled token was not appended, or the sequence changed some other way) is built again from the
tokens, so the counts are always those of `token_ids`."""

from __future__ import annotations

import torch

from batching.sequence import Sequence


class TokenCounts:
    def __init__(self):
        self.rows: dict[Sequence, int] = {}  # sequence -> its row
        self.counted: dict[Sequence, int] = {}  # sequence -> how many of its tokens the row counts
        self.free: list[int] = []
        self.seen: torch.Tensor | None = None  # [R, V] bool: in the prompt or output
        self.output: torch.Tensor | None = None  # [R, V] int32: occurrences in the output

    def gather(self, seqs: list[Sequence], vocab: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(rows [P] long, seen [P, V] bool, output counts [P, V] int32) of `seqs`, rows built as needed."""
        self._fit(len(self.rows) + len(seqs), vocab, device)
        stale = [s for s in seqs if self.counted.get(s) != s.num_tokens]
        if stale:
            self._build(stale)
        assert self.seen is not None and self.output is not None
        rows = torch.tensor([self.rows[s] for s in seqs], dtype=torch.long, device=device)
        return rows, self.seen.index_select(0, rows), self.output.index_select(0, rows)

    def add(self, seqs: list[Sequence], rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count `tokens` [P] (on the device), sampled for `seqs` this step, as their next output tokens."""
        assert self.seen is not None and self.output is not None
        self.seen.index_put_((rows, tokens), torch.ones((), dtype=torch.bool, device=rows.device))
        one = torch.ones((), dtype=self.output.dtype, device=rows.device).expand(len(seqs))
        self.output.index_put_((rows, tokens), one, accumulate=True)
        for s in seqs:
            self.counted[s] = s.num_tokens + 1  # the engine appends the sampled token

    def forget(self, seq: Sequence) -> None:
        row = self.rows.pop(seq, None)
        if row is not None:
            del self.counted[seq]
            self.free.append(row)

    def _fit(self, needed: int, vocab: int, device: torch.device) -> None:
        """Room for `needed` rows (the table doubles when full)."""
        if self.seen is not None and self.seen.shape[1] == vocab and self.seen.device == device:
            if needed <= self.seen.shape[0]:
                return
            extra = max(needed, 2 * self.seen.shape[0]) - self.seen.shape[0]
            self.free.extend(range(self.seen.shape[0], self.seen.shape[0] + extra))
            self.seen = torch.cat([self.seen, self.seen.new_zeros(extra, vocab)])
            assert self.output is not None
            self.output = torch.cat([self.output, self.output.new_zeros(extra, vocab)])
            return
        size = max(needed, 8)
        self.rows.clear()
        self.counted.clear()
        self.free = list(range(size))
        self.seen = torch.zeros(size, vocab, dtype=torch.bool, device=device)
        self.output = torch.zeros(size, vocab, dtype=torch.int32, device=device)

    def _build(self, seqs: list[Sequence]) -> None:
        """Rows of `seqs` from their tokens (one scatter for all)."""
        assert self.seen is not None and self.output is not None
        for s in seqs:
            if s not in self.rows:
                self.rows[s] = self.free.pop()
        device = self.seen.device
        index = torch.tensor([self.rows[s] for s in seqs], dtype=torch.long, device=device)
        self.seen[index] = False
        self.output[index] = 0
        at: list[int] = []  # row, for each token of each sequence
        ids: list[int] = []
        out_at: list[int] = []
        out_ids: list[int] = []
        for s in seqs:
            row = self.rows[s]
            at += [row] * s.num_tokens
            ids += s.token_ids
            out_at += [row] * s.num_output_tokens
            out_ids += s.output_token_ids
            self.counted[s] = s.num_tokens
        t = torch.tensor
        self.seen.index_put_((t(at, device=device), t(ids, device=device)), t(True, device=device))
        if out_ids:
            ones = torch.ones(len(out_ids), dtype=self.output.dtype, device=device)
            self.output.index_put_(
                (t(out_at, device=device), t(out_ids, device=device)), ones, accumulate=True
            )
