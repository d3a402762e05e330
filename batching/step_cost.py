"""What a step costs, in prefill tokens, fitted on the engine's own steps. numpy only, no torch.

The scheduler fills each step up to a budget (`max_num_batched_tokens`). For steps of even duration
(decodes never wait long behind a step) that budget has to price what really takes time, and
plain token counts do not: on the CPU, a fit over ~10,000 steps of bench/serving.py found a decode
costing ~3.5 prefill tokens (its LM-head row, sampling, per-row work) plus s/106 for its context
of s tokens, and a prefill chunk with context paying s/23 for gathering it, none of which the budget
saw. These steps ran up to ~40% over a full-budget one.

`StepCostModel` records each step's make-up (`features`, taken before the step runs) and its
duration, and every `REFIT_EVERY` steps fits, by least squares over the last `WINDOW` steps,

    seconds = t0 + a (prefill tokens) + b sum n(s + n/2) + c sum s [chunks] + d decodes + e sum s [decodes]

then hands the scheduler `StepCosts` in units of one prefill token (a). Until the first fit, and
whenever a fit is unusable, the scheduler keeps the estimate from the model's weights (attention
only, decodes at one token), so short runs and tests schedule as they always did.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

REFIT_EVERY = 256  # steps between fits
WINDOW = 4096  # steps a fit looks at
MIN_STEPS = 512  # steps before the first fit
_computed = attrgetter("num_computed_tokens")
NAMES = ("prefill_tokens", "prefill_attention", "chunk_context", "decodes", "decode_context")


@dataclass(frozen=True, slots=True)
class StepCosts:
    """Budget prices, in prefill tokens. None: that term is not charged."""

    context_per_token: float | None = None  # chunk of n at s: n (1 + (s + n/2) / C)
    chunk_context_per_token: float | None = None  # + s / this, for a chunk with context
    decode_tokens: float = 1.0  # a decode: this
    decode_context_per_token: float | None = None  # + s / this


def attention_context_per_token(model, query_width: float | None = None) -> float:
    """C from the weights: how many tokens of context one token's attention must span to cost as much
    as the rest of its forward pass (the decoder's linear weights per layer, one multiply-add each
    per token, over the multiply-adds of q·k and p·v per key for every head). About 1,400 for a
    256-wide model, about 12,000 for a 7B one."""
    mc = model.config.get_text_config(decoder=True)  # multimodal configs nest the decoder's
    weights = model.num_parameters(exclude_embeddings=True)
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and embed is not None and head.weight is not embed.weight:
        weights -= head.weight.numel()  # the LM head runs once per sampled row, not per token
    if query_width is None:  # query heads x head size (the engine passes what the layers pass)
        head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
        query_width = mc.num_attention_heads * head_dim
    return weights / mc.num_hidden_layers / (2 * query_width)


def features(
    seqs, num_scheduled_tokens, num_decodes: int = 0, known_decode_context: int | None = None
) -> tuple[float, ...]:
    """A scheduled step's make-up (see NAMES), from its sequences before they advance. The first `num_decodes`
    of `seqs` are known decodes (SchedulerOutput.num_decodes): summed in one pass, not tested one by one, or
    not at all where the sum of their num_computed_tokens is known (SchedulerOutput.decode_context)."""
    tokens = attention = chunk_context = 0.0
    decodes = float(num_decodes)
    decode_context = float(
        sum(map(_computed, seqs[:num_decodes])) if known_decode_context is None else known_decode_context
    )
    for seq, n in zip(seqs[num_decodes:], num_scheduled_tokens[num_decodes:]):
        s = seq.num_computed_tokens
        if n == 1 and seq.is_decoding:
            decodes += 1
            decode_context += s
        else:
            tokens += n
            attention += n * (s + n / 2)
            chunk_context += s
    return tokens, attention, chunk_context, decodes, decode_context


class StepCostModel:
    def __init__(self):
        self._rows: deque[tuple[float, ...]] = deque(maxlen=WINDOW)
        self._seconds: deque[float] = deque(maxlen=WINDOW)
        self._since_fit = 0
        self.num_fits = 0  # usable fits so far

    def record(self, step_features: tuple[float, ...], seconds: float) -> StepCosts | None:
        """Add a step; returns fresh costs when a fit is due and usable, else None."""
        self._rows.append(step_features)
        self._seconds.append(seconds)
        self._since_fit += 1
        if len(self._rows) < MIN_STEPS or self._since_fit < REFIT_EVERY:
            return None
        self._since_fit = 0
        costs = self.fit()
        self.num_fits += costs is not None
        return costs

    def fit(self) -> StepCosts | None:
        """Least squares with every term non-negative (a term fitted below zero is dropped and the
        rest refitted). None without a positive price per prefill token."""
        x = np.column_stack([np.ones(len(self._rows)), np.asarray(self._rows, dtype=float)])
        y = np.asarray(self._seconds, dtype=float)
        keep = [i for i in range(x.shape[1]) if i == 0 or x[:, i].any()]
        while True:
            coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
            negative = [k for k, c in zip(keep, coef) if k > 0 and c < 0]
            if not negative:
                break
            keep = [k for k in keep if k != negative[0]]
        fitted = dict(zip(keep, coef))
        per_token = fitted.get(1, 0.0)
        if not per_token > 0 or not all(math.isfinite(c) for c in coef):
            return None

        def per(i):  # tokens of context per prefill token's worth, for a term priced per context token
            return per_token / fitted[i] if fitted.get(i, 0) > 0 else None

        return StepCosts(
            context_per_token=per(2),
            chunk_context_per_token=per(3),
            decode_tokens=max(1.0, fitted.get(4, 0.0) / per_token),
            decode_context_per_token=per(5),
        )
