"""A step's sampled tokens recorded: when a sequence stops, and its text (EOS, stop ids and strings, limits;
text by detokenizer.py)."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from batching.detokenizer import Detokenizer
from batching.sampling_params import SamplingParams
from batching.sequence import Sequence, SequenceStatus


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: set[int]):
        self.detokenize = Detokenizer(tokenizer)
        self.eos_token_ids = frozenset(eos_token_ids)

    def stop_ids(self, params: SamplingParams) -> frozenset[int]:
        """The token ids that end a request with `params` (once it has min_tokens): the end of sequence unless
        ignored, and its stop_token_ids (Sequence.stop_ids)."""
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        return eos.union(params.stop_token_ids)

    def advance(
        self, seqs: Seq[Sequence], tokens: Seq[int], now: float
    ) -> tuple[dict[int, SequenceStatus], list[int]]:
        """Each of `seqs` gets its token of `tokens` (in place of its placeholder if it has one, see engine.py),
        its first token's time, its text (in one pass of the detokenizer). Returns the rows that finished, with
        their status, and the rows whose sequence has a grammar (the engine feeds it the token). One loop over
        the step's sequences does all that needs no text; stop strings, the only check that reads the text,
        run after the detokenizer, for the sequences that have them.

        As vLLM: a token that stops the request (the end of sequence, a stop_token_id) adds no text unless
        include_stop_str_in_output; min_tokens holds back every stop before it (stop strings: see below)."""
        stopped, length = SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH
        ended: dict[int, SequenceStatus] = {}
        with_grammar: list[int] = []
        to_decode: list[Sequence] = []
        with_strings: list[tuple[int, Sequence, int]] = []  # (its row, it, its text's length before)
        decode_it = to_decode.append
        for i, seq in enumerate(seqs):
            token = tokens[i]
            ids = seq.token_ids
            if seq.pending_row >= 0:  # its placeholder, last in token_ids
                ids[-1] = token
                seq.pending_row = -1
            else:
                ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            p = seq.params
            if p.json_schema is not None:
                with_grammar.append(i)
            # the sampler held the stop tokens back too before min_tokens
            if token in seq.stop_ids and (
                not p.min_tokens or len(ids) - seq.num_prompt_tokens >= p.min_tokens
            ):
                ended[i] = stopped
                if p.include_stop_str_in_output:
                    to_decode.append(seq)
                continue
            decode_it(seq)
            if p.stop:
                with_strings.append((i, seq, len(seq.text)))
            # max_tokens, or the model's length (a stop string found below comes first)
            if len(ids) >= seq.max_num_tokens:
                ended[i] = length
        self.detokenize(to_decode)
        # stop strings end a request once len(output) > min_tokens, matched in the text added since the last
        # token (and the stop's length - 1 characters before it), as vLLM's detokenizer checks them
        for i, seq, old_len in with_strings:
            if (
                len(seq.token_ids) - seq.num_prompt_tokens > seq.params.min_tokens
                and len(seq.text) > old_len
                and self._cut_at_stop_string(seq, old_len)
            ):
                ended[i] = stopped
        return ended, with_grammar

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
