"""A step's rows as the state layers run them (state_layers.py): which rows run from an empty state, which
resume a chunk from a sequence's state in one call, and which run one token per call in waves across the
step's sequences. The runner builds it (`build_step`) and the step's attention metadata carries it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batching.state_cache import StateCache


@dataclass(slots=True)
class StateStep:
    """A step's rows as the state layers run them (built by the runner; the tensors on the device)."""

    cache: StateCache
    num_rows: int
    # the prompt tokens of sequences without a state: (first row, number of rows, their slot as a [1] tensor)
    fresh: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)
    # layers that resume a chunk from its state in one call: the later prompt chunks of two tokens or
    # more, each in one call (first row, rows, slot [1]); then every other token in waves (rows [n],
    # slots [n]), wave j holding the j-th such token of each sequence
    chunks: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)
    waves: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # layers that do not: every token of a sequence with a state, in waves
    token_waves: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


def build_step(cache: StateCache, seqs, q_lens: list[int], device: torch.device) -> StateStep:
    """The StateStep of a step whose segments (in row order) are `seqs` with `q_lens` rows each."""
    step = StateStep(cache, sum(q_lens))
    singles: list[tuple[range, int]] = []  # (rows that run one per call, slot), for each kind of layer
    tokens: list[tuple[range, int]] = []
    row = 0
    for seq, n in zip(seqs, q_lens, strict=True):
        slot = seq.state_slot
        assert slot is not None, f"{seq} runs without a state slot"
        prompt = min(n, max(0, seq.num_prompt_tokens - seq.num_computed_tokens))  # its prompt tokens here
        if seq.num_computed_tokens == 0:
            step.fresh.append((row, prompt, torch.tensor([slot], device=device)))
            singles.append((range(row + prompt, row + n), slot))
            tokens.append((range(row + prompt, row + n), slot))
        else:
            chunk = prompt if prompt > 1 else 0
            if chunk:
                step.chunks.append((row, chunk, torch.tensor([slot], device=device)))
            singles.append((range(row + chunk, row + n), slot))
            tokens.append((range(row, row + n), slot))
        row += n
    step.waves = _waves(singles, device)
    step.token_waves = _waves(tokens, device) if step.chunks else step.waves  # the same without chunks
    return step


def _waves(runs: list[tuple[range, int]], device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Wave j: the j-th row of each run, with its slot."""
    longest = max((len(rows) for rows, _ in runs), default=0)
    return [
        _wave_of([(rows[j], slot) for rows, slot in runs if len(rows) > j], device) for j in range(longest)
    ]


def _wave_of(rows_and_slots: list[tuple[int, int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.tensor([r for r, _ in rows_and_slots], device=device),
        torch.tensor([s for _, s in rows_and_slots], device=device),
    )
