"""Logits rows → next tokens: greedy, temperature, top-k, top-p; seeded per (seed, token index)."""

from __future__ import annotations

import torch

from batching.sequence import Sequence

_MASK64 = (1 << 63) - 1


def token_seed(seed: int, index: int) -> int:
    """A 63-bit seed for output token `index` of a request seeded with `seed` (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & _MASK64


class Sampler:
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits: [N, V], one row per sequence that gets a new token this step."""
        tokens = logits.argmax(dim=-1)  # greedy rows done here
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if sampled:
            tokens = tokens.clone()
            for i in sampled:
                tokens[i] = self._sample_row(logits[i], seqs[i])
        return tokens.tolist()

    def _sample_row(self, row: torch.Tensor, seq: Sequence) -> torch.Tensor:
        p = seq.params
        row = row.float() / p.temperature  # [V]
        if p.top_k and p.top_k < row.shape[0]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
            drop = (
                cum - torch.softmax(sorted_logits, dim=-1) >= p.top_p
            )  # keep the smallest set reaching top_p
            row = row.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = torch.softmax(row, dim=-1)
        # exponential race (equivalent to sampling from probs), with noise from (seed, token index) only,
        # so a request draws the same tokens alone, in any batch, after preemption or a restart
        gen = torch.Generator(device=row.device)
        gen.manual_seed(token_seed(seq.sample_seed, seq.num_output_tokens))
        noise = torch.empty_like(probs).exponential_(generator=gen)
        return (probs / noise).argmax()
