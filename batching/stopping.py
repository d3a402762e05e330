"""When a sequence stops, and its text: EOS, stop ids and strings, limits (text by detokenizer.py)."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from batching.detokenizer import Detokenizer
from batching.sequence import Sequence, SequenceStatus


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: set[int]):
        self.detokenize = Detokenizer(tokenizer)
        self.eos_token_ids = frozenset(eos_token_ids)

    def check_step(self, seqs: Seq[Sequence], tokens: Seq[int]) -> list[SequenceStatus | None]:
        """Called after each of `seqs` had its token of `tokens` appended: their texts updated (in one pass
        of the detokenizer); each one's finished status, or None.

        As vLLM: a token that stops the request (the end of sequence, a stop_token_id) adds no text unless
        include_stop_str_in_output; min_tokens holds back every stop before it (stop strings: see below)."""
        eos = self.eos_token_ids
        stopped: list[bool] = []
        to_decode: list[Sequence] = []
        old_lens: list[int] = []
        for seq, token in zip(seqs, tokens, strict=True):
            p = seq.params
            old_lens.append(len(seq.text))
            # the sampler held the stop tokens back too before min_tokens
            stop_token = (
                (token in eos and not p.ignore_eos) or token in p.stop_token_ids
            ) and seq.num_output_tokens >= p.min_tokens
            stopped.append(stop_token)
            if not stop_token or p.include_stop_str_in_output:
                to_decode.append(seq)
        self.detokenize(to_decode)
        statuses: list[SequenceStatus | None] = []
        for seq, stop_token, old_len in zip(seqs, stopped, old_lens):
            p = seq.params
            num_tokens = len(seq.token_ids)
            if stop_token:
                statuses.append(SequenceStatus.FINISHED_STOPPED)
            # stop strings end a request once len(output) > min_tokens, matched in the text added since the
            # last token (and the stop's length - 1 characters before it), as vLLM's detokenizer checks them
            elif (
                p.stop
                and num_tokens - seq.num_prompt_tokens > p.min_tokens
                and len(seq.text) > old_len
                and self._cut_at_stop_string(seq, old_len)
            ):
                statuses.append(SequenceStatus.FINISHED_STOPPED)
            elif num_tokens >= seq.max_num_tokens:  # max_tokens, or the model's length
                statuses.append(SequenceStatus.FINISHED_LENGTH)
            else:
                statuses.append(None)
        return statuses

    @staticmethod
    def _cut_at_stop_string(seq: Sequence, old_len: int) -> bool:
        """Cut the text at the earliest stop string that the text added since `old_len` completes: before it,
        or after it with include_stop_str_in_output."""
        text = seq.text
        found = [
            (at, len(stop))
            for stop in seq.params.stop
            if (at := text.find(stop, max(0, old_len - len(stop) + 1))) != -1
        ]
        if not found:
            return False
        at, length = min(found, key=lambda match: match[0])
        seq.text = text[: at + length] if seq.params.include_stop_str_in_output else text[:at]
        return True
