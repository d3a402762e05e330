"""A job's stored log probabilities (its `logprobs` column: {"prompt": [...], "tokens": [...]}, each entry
[token_id, logprob, [[id, logprob], ...]]) in the shapes OpenAI's and vLLM's replies give them:

- completions (`logprobs`): {tokens, token_logprobs, top_logprobs, text_offset}, the prompt's tokens first
  with `echo` (its first token has no log probability: null); a top_logprobs entry holds the k most likely
  tokens and the token itself, as vLLM's do;
- chat (`logprobs` + `top_logprobs`): {"content": [{token, logprob, bytes, top_logprobs}]};
- vLLM's `prompt_logprobs`: one entry per prompt token (null for the first), {token_id: {logprob, rank,
  decoded_token}} (a token below the top ones has rank null: genq keeps only the top ones' ranks).

A token's string is `tokenizer.decode([id])`, as vLLM gives it (a piece of a character decodes to U+FFFD).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Entry = Sequence[Any]  # [token_id, logprob or None, [[id, logprob], ...]]


def completion_logprobs(entries: Sequence[Entry], tokenizer, text_offset: int = 0) -> dict:
    """OpenAI's completions logprobs of these tokens, their text starting at character `text_offset`."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, logprob, top in entries:
        text = _decode(tokenizer, token)
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        if logprob is None:
            out["top_logprobs"].append(None)
        else:
            alternatives = {_decode(tokenizer, t): lp for t, lp in top}
            alternatives.setdefault(text, logprob)
            out["top_logprobs"].append(alternatives)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
    return out


def chat_logprobs(entries: Sequence[Entry], tokenizer) -> dict:
    """OpenAI's chat logprobs of these (output) tokens."""
    return {
        "content": [
            dict(
                _chat_token(tokenizer, token, logprob),
                top_logprobs=[_chat_token(tokenizer, t, lp) for t, lp in top],
            )
            for token, logprob, top in entries
        ]
    }


def vllm_prompt_logprobs(entries: Sequence[Entry], tokenizer) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first, else its and the top ones' entries."""
    out: list[dict | None] = []
    for token, logprob, top in entries:
        if logprob is None:
            out.append(None)
            continue
        ranked = {
            t: {"logprob": lp, "rank": rank, "decoded_token": _decode(tokenizer, t)}
            for rank, (t, lp) in enumerate(top, 1)
        }
        if token not in ranked:  # not among the top ones: its rank is not known, only that it is lower
            ranked[token] = {"logprob": logprob, "rank": None, "decoded_token": _decode(tokenizer, token)}
        out.append({str(t): value for t, value in ranked.items()})
    return out


def _chat_token(tokenizer, token: int, logprob: float) -> dict:
    text = _decode(tokenizer, token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _decode(tokenizer, token: int) -> str:
    return tokenizer.decode([token]) if tokenizer is not None else f"token_id:{token}"
