"""Per-request sampling and stopping parameters."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    # vLLM's: until this many output tokens (resumed ones included), the end of sequence and stop_token_ids
    # cannot be sampled and stop strings do not end the request
    min_tokens: int = 0
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # in (0, 1]; 1: off
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # in [0, 1]: drop tokens less likely than min_p times the most likely; 0: off
    # penalties on the logits before sampling (and before greedy's argmax): vLLM's repetition_penalty (1: off)
    # divides a positive / multiplies a negative logit of any token of the prompt or output, as transformers'
    # RepetitionPenaltyLogitsProcessor; OpenAI's presence / frequency penalties (0: off) subtract from the
    # logits of output tokens once, or once per occurrence
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # OpenAI's logit_bias: {token id: bias in [-100, 100]}, added to those tokens' logits before anything else
    # (penalties, temperature, top-k/p, greedy's argmax); log probabilities stay the model's
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None  # token i draws from randomness derived from (seed, i)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # vLLM's: the stop string that ended the request stays at the end of the text (and a stop token's text:
    # by default a token that ends the request, EOS or a stop_token_id, adds no text)
    include_stop_str_in_output: bool = False
    # vLLM's: False keeps special tokens (BOS, EOS, chat markers) in the text
    skip_special_tokens: bool = True
    # vLLM's: False makes no text in the engine (RequestOutput.text stays ""; token ids only), for a consumer
    # that makes the text itself from the token ids (workers/engine_host.py, with detokenizer.OutputText).
    # Stop strings read the text, so they need it
    detokenize: bool = True
    # log probabilities (batching/logprobs.py): of each output token and its `logprobs` most likely
    # alternatives (0: the token's alone); of each prompt token but the first, with `prompt_logprobs`
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # "cumulative": each RequestOutput holds the whole output so far; "delta": only what changed since the
    # request's previous output (new token ids, new text, the prompt ids in the first one), and the text is
    # held back by len(longest stop string) - 1 characters until the request ends, so it is never cut later
    output_kind: str = "cumulative"
    # structured output (batching/grammar.py): a JSON schema, as a JSON string, every output must follow
    # (grammar.JSON_OBJECT_SCHEMA: any JSON object); the request stops ("stop") when its JSON is complete
    json_schema: str | None = None

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if (
            isinstance(self.min_tokens, bool)
            or not isinstance(self.min_tokens, int)
            or not 0 <= self.min_tokens <= self.max_tokens
        ):
            raise ValueError(
                f"min_tokens must be an integer from 0 to max_tokens ({self.max_tokens}), got {self.min_tokens!r}"
            )
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.repetition_penalty, (int, float)) or not 0.0 < self.repetition_penalty < float(
            "inf"
        ):
            raise ValueError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id to bias, got {self.logit_bias!r}")
        self.logit_bias = dict(self.logit_bias)
        for token, bias in self.logit_bias.items():
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias: keys must be token ids (integers >= 0), got {token!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias[{token}] must be a number from -100 to 100, got {bias!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        self.stop_token_ids = list(self.stop_token_ids)
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be a list of non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be None or an integer >= 0, got {value!r}")
        if self.json_schema is not None and not isinstance(self.json_schema, str):
            raise ValueError(
                f"json_schema must be None or a JSON string, got {type(self.json_schema).__name__}"
            )
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need the text: detokenize must be true when stop is set")
        if self.output_kind not in ("cumulative", "delta"):
            raise ValueError(f"output_kind must be 'cumulative' or 'delta', got {self.output_kind!r}")

    @property
    def holdback(self) -> int:
        """Characters of a running request's text that a stop string may still cut."""
        return max(map(len, self.stop), default=1) - 1

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
