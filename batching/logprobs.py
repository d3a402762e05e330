"""Log probabilities of tokens: the log-softmax of the model's logits rows (before temperature or any other
change the sampler makes), the given token's and the k most likely, in one batched pass per step."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token's log probability, and the most likely tokens at its position (most likely first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def as_list(self) -> list:
        """[token_id, logprob, [[id, logprob], ...]]: the JSON form (compact, as the job row stores it)."""
        return [self.token_id, self.logprob, [list(pair) for pair in self.top]]


def token_logprobs(logits: torch.Tensor, token_ids: list[int], top: list[int]) -> list[TokenLogprob]:
    """logits: [R, V]; each row's log probability of token_ids[r] and of its top[r] most likely tokens."""
    logprobs = torch.log_softmax(logits, dim=-1)  # [R, V], in the logits' dtype
    ids = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
    chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()  # [R]
    k = max(top, default=0)
    if k:
        values, indices = torch.topk(logprobs, min(k, logprobs.shape[-1]), dim=-1)  # [R, k]
        values_l, indices_l = values.tolist(), indices.tolist()
    return [
        TokenLogprob(t, lp, tuple(zip(indices_l[r][: top[r]], values_l[r][: top[r]])) if top[r] else ())
        for r, (t, lp) in enumerate(zip(token_ids, chosen))
    ]
