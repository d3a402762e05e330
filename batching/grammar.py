"""Structured output: a JSON schema → a grammar matcher per sequence (llguidance), the allowed-token bitmask of
a step's constrained rows, and the tokens each matcher consumes. No torch here: the sampler applies the masks.

A matcher lives on its Sequence (`seq.grammar`), so preemption and swap keep its state; a resumed request
(resume_token_ids) rebuilds it by consuming the resumed tokens."""

from __future__ import annotations

from functools import lru_cache

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np

# the grammar of `{"type": "json_object"}`: any JSON object
JSON_OBJECT_SCHEMA = '{"type": "object"}'


@lru_cache(maxsize=256)
def compile_json_schema(json_schema: str) -> str:
    """llguidance's grammar for `json_schema` (a JSON string); ValueError naming response_format if it has
    none (not JSON, an unknown type, ...). Compact JSON (no free whitespace): a model cannot pad its output
    with blanks until max_tokens. Needs no tokenizer: the API checks requests with it."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json_schema, overrides={"whitespace_flexible": False}
        )
    except ValueError as exc:
        raise ValueError(f"response_format: the JSON schema cannot be compiled: {exc}") from exc
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"response_format: the JSON schema cannot be compiled: {error}")
    return grammar


_executor: llguidance.LLExecutor | None = None


def allowed_tokens(matchers: list[llguidance.LLMatcher], vocab_size: int) -> np.ndarray:
    """[len(matchers), ceil(vocab_size / 32)] int32: bit v of row r set when token v may follow matcher r's
    tokens; filled in parallel, off the GIL."""
    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor()
    mask = llguidance.numpy.allocate_token_bitmask(len(matchers), vocab_size)
    llguidance.numpy.fill_next_token_bitmask_par(_executor, [(m, i) for i, m in enumerate(matchers)], mask)
    return mask


class Grammars:
    """Builds matchers on one engine's tokenizer."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]):
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._eos = sorted(eos_token_ids)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None  # built on first use (ms to 1 s)

    def matcher(self, json_schema: str, resumed_token_ids: list[int]) -> llguidance.LLMatcher:
        """A matcher for `json_schema` that has consumed `resumed_token_ids`. Raises ValueError naming
        response_format if the schema cannot be compiled or the resumed tokens do not follow it."""
        if self._tokenizer is None:
            raise ValueError("response_format: this model has no tokenizer to spell a grammar with")
        if self._ll_tokenizer is None:
            self._ll_tokenizer = llguidance.hf.from_tokenizer(
                self._tokenizer, n_vocab=self.vocab_size, eos_token=self._eos or None
            )
        matcher = llguidance.LLMatcher(self._ll_tokenizer, compile_json_schema(json_schema), log_level=0)
        if matcher.is_error():
            raise ValueError(f"response_format: the JSON schema cannot be compiled: {matcher.get_error()}")
        if resumed_token_ids and not matcher.consume_tokens(resumed_token_ids):
            raise ValueError(
                f"resume_token_ids do not follow the response_format's schema: {matcher.get_error()}"
            )
        return matcher
