"""A request's state inside the engine: tokens, progress, blocks, status."""

from __future__ import annotations

import enum
import time

from batching.sampling_params import SamplingParams


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
        # prefix caching (block_manager.py): chained hashes of the full blocks of token_ids, computed as
        # needed, and how many leading blocks of block_table were offered to the cache already
        self.block_hashes: list[bytes] = []
        self.num_cache_offered_blocks = 0
        self.status = SequenceStatus.WAITING
        self.num_preemptions = 0
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.sample_seed = sample_seed
        # incremental detokenization state (see StopChecker._detokenize)
        self.text = ""
        self.prefix_offset = self.num_prompt_tokens
        self.read_offset = self.num_prompt_tokens

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
    def is_decoding(self) -> bool:
        """Prefill done: one new token per step."""
        return self.num_computed_tokens == len(self.token_ids) - 1 and self.num_output_tokens > 0

    @property
    def finished(self) -> bool:
        return self.status >= SequenceStatus.FINISHED_STOPPED

    def __repr__(self) -> str:
        return (
            f"Sequence({self.req_id!r}, p{self.priority}, {self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens}, blocks={len(self.block_table)})"
        )
