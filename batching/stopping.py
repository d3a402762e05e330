"""When a sequence stops, and its text: incremental detokenization, EOS, stop ids and strings, limits."""

from __future__ import annotations

from batching.sequence import Sequence, SequenceStatus


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer  # None: token ids only, no text
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def check(self, seq: Sequence, token: int) -> SequenceStatus | None:
        """Called after `token` was appended: update the text; the finished status, or None.

        As vLLM: a token that stops the request (the end of sequence, a stop_token_id) adds no text unless
        include_stop_str_in_output; min_tokens holds back every stop before it (stop strings: see below)."""
        p = seq.params
        old_len = len(seq.text)
        held = seq.num_output_tokens < p.min_tokens  # the sampler held the stop tokens back too
        stop_token = not held and (
            (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
        )
        if not stop_token or p.include_stop_str_in_output:
            self._detokenize(seq)
        if stop_token:
            return SequenceStatus.FINISHED_STOPPED
        # stop strings end a request once len(output) > min_tokens, matched in the text added since the last
        # token (and the stop's length - 1 characters before it), as vLLM's detokenizer checks them
        if (
            p.stop
            and seq.num_output_tokens > p.min_tokens
            and len(seq.text) > old_len
            and self._cut_at_stop_string(seq, old_len)
        ):
            return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _detokenize(self, seq: Sequence) -> None:
        """Append the text of new tokens; a token that ends mid-character waits for the next one.

        Decodes a short window (prefix_offset..) and keeps what it adds beyond the window's known
        part, so tokenizers that merge across token boundaries (leading spaces) decode correctly.
        """
        if self.tokenizer is None:
            return
        ids = seq.token_ids
        skip = seq.params.skip_special_tokens
        prefix = self.tokenizer.decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            seq.text += full[len(prefix) :]
            seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)

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
