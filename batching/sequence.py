"""A request's state inside the engine: tokens, progress, blocks, status."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from batching.sampling_params import SamplingParams

if TYPE_CHECKING:
    from llguidance import LLMatcher


class SequenceStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    # every FINISHED_* sorts after the live states: "finished?" is one comparison
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED


FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


PENDING_TOKEN = -1  # token_ids' last entry while its value is still on the device (engine.py)


class Sequence:
    """One request. `token_ids` = prompt + generated; KV exists for the first `num_computed_tokens`."""

    __slots__ = (
        "req_id",
        "priority",
        "arrival_time",
        "params",
        "token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "block_table",
        "host_block_table",
        "state_slot",
        "host_state_slot",
        "block_hashes",
        "num_cache_offered_blocks",
        "status",
        "num_preemptions",
        "first_token_time",
        "finish_time",
        "sample_seed",
        "text",
        "prefix_offset",
        "read_offset",
        "num_reported_tokens",
        "num_reported_chars",
        "reported_facts",
        "logprobs",
        "prompt_logprobs",
        "grammar",
        "plain",
        "overlappable",
        "pending_row",
        "stop_ids",
        "max_num_tokens",
        "predicted_output_tokens",
        "deadline",
        "order_key",
    )

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int,
        sample_seed: int,
        resume_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        max_model_len: int | None = None,
        predicted_output_tokens: int | None = None,
        deadline: float | None = None,
    ):
        self.req_id = req_id
        self.priority = priority
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.params = params
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids = list(prompt_token_ids) + list(resume_token_ids or ())
        self.num_computed_tokens = 0
        self.block_table: list[int] = []  # device blocks, in order
        self.host_block_table: list[int] = []  # host blocks while swapped out
        # models with state layers (state_cache.py): its state slot while running, its host slot while swapped
        self.state_slot: int | None = None
        self.host_state_slot: int | None = None
        # prefix caching (block_manager.py): chained hashes of the full blocks of token_ids, computed as
        # needed, and how many leading blocks of block_table were offered to the cache already
        self.block_hashes: list[bytes] = []
        self.num_cache_offered_blocks = 0
        self.status = SequenceStatus.WAITING
        self.num_preemptions = 0
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.sample_seed = sample_seed
        # incremental detokenization state (detokenizer.py)
        self.text = ""
        self.prefix_offset = self.num_prompt_tokens
        self.read_offset = self.num_prompt_tokens
        # output_kind "delta": output tokens and text characters reported in earlier outputs
        self.num_reported_tokens = 0
        self.num_reported_chars = 0
        # (num_preemptions, first_token_time) as last reported (step_deltas.py); None: never reported
        self.reported_facts: tuple[int, float | None] | None = None
        # with params.logprobs: output token j's (TokenLogprob); with params.prompt_logprobs: prompt token
        # i + 1's (the first has none). A preempted sequence keeps them; a resumed one computes its resumed
        # tokens' from their prefill
        self.logprobs: list = []
        self.prompt_logprobs: list = []
        # with params.json_schema: its grammar matcher (batching/grammar.py), fed every output token; it
        # stays with the sequence through preemption and swap
        self.grammar: LLMatcher | None = None
        # its next token is the logits' argmax, nothing applied before it: the sampler's fast path
        self.plain = (
            params.greedy
            and not params.logit_bias
            and not params.penalized
            and params.min_tokens == 0
            and params.json_schema is None
        )
        # the next step may be scheduled before its token is on the host (engine.py, async scheduling):
        # nothing that step computes depends on the token's value on the host
        self.overlappable = (
            params.json_schema is None
            and not params.penalized
            and params.logprobs is None
            and params.prompt_logprobs is None
        )
        # with async scheduling, while its last token is still on the device: token_ids ends with a
        # placeholder (PENDING_TOKEN), and this is that token's row in its step's sampled tokens; else -1
        self.pending_row = -1
        # the token ids that end it once it has min_tokens: its stop_token_ids and, unless ignore_eos, the
        # model's end of sequence (the engine sets them: StopChecker.stop_ids)
        self.stop_ids: frozenset[int] = frozenset(params.stop_token_ids)
        # it stops at this length whatever it samples: max_tokens, or the model's length
        self.max_num_tokens = self.num_prompt_tokens + params.max_tokens
        if max_model_len is not None:
            self.max_num_tokens = min(self.max_num_tokens, max_model_len)
        # scheduling within its priority class (scheduler.py): the output it is expected to reach (None:
        # max_tokens), when it is wanted (seconds since the epoch; None: no deadline), and its place in the
        # class, set when the scheduler takes it and kept through preemption (arrival_time under "fcfs")
        self.predicted_output_tokens = predicted_output_tokens
        self.deadline = deadline
        self.order_key = self.arrival_time

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_predicted_tokens_left(self) -> int:
        """Tokens it is expected still to compute: its uncomputed ones (prompt, resumed tokens) and the output
        it is predicted to produce beyond what it has (the prediction capped by max_tokens and the model)."""
        cap = self.max_num_tokens - self.num_prompt_tokens
        predicted = cap if self.predicted_output_tokens is None else min(self.predicted_output_tokens, cap)
        return self.num_uncomputed_tokens + max(0, predicted - self.num_output_tokens)

    @property
    def is_decoding(self) -> bool:
        """Prefill done: one new token per step."""
        return self.num_computed_tokens == len(self.token_ids) - 1 and self.num_output_tokens > 0

    def logprob_positions(self, start: int, n: int) -> range:
        """The positions among [start, start + n) whose logits give a log probability this sequence still
        lacks (position q's logits rank token q + 1): prompt tokens', and resumed output tokens'. The last
        position is the sampler's row, never one of these."""
        p, prompt = self.params, self.num_prompt_tokens
        if p.prompt_logprobs is not None and len(self.prompt_logprobs) < prompt - 1:
            first = len(self.prompt_logprobs)
        elif p.logprobs is not None:
            first = prompt - 1 + len(self.logprobs)
        else:
            return range(0)
        end = self.num_tokens - 1 if p.logprobs is not None else prompt - 1
        return range(max(first, start), min(end, start + n))

    @property
    def lacks_logprobs(self) -> bool:
        """Whether some of its tokens' log probabilities need their positions computed (no cached prefix)."""
        return bool(self.logprob_positions(0, self.num_tokens))

    @property
    def finished(self) -> bool:
        return self.status >= SequenceStatus.FINISHED_STOPPED

    def __repr__(self) -> str:
        return (
            f"Sequence({self.req_id!r}, p{self.priority}, {self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens}, blocks={len(self.block_table)})"
        )
