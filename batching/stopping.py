"""A step's sampled tokens recorded: when a sequence stops, and its text (EOS, stop ids and strings, limits;
text by detokenizer.py)."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from operator import attrgetter

from batching.detokenizer import Detokenizer
from batching.sampling_params import SamplingParams
from batching.sequence import Sequence, SequenceStatus


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: set[int]):
        self.detokenize = Detokenizer(tokenizer)
        self.eos_token_ids = frozenset(eos_token_ids)
        # the last advance's sequences (`_PlainBatch`), when it ended none and some were plain: the next advance
        # of the same sequences takes `_advance_plain`
        self._plain: _PlainBatch | None = None

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
        include_stop_str_in_output; min_tokens holds back every stop before it (stop strings: see below).

        The steady step (the same sequences as the last advance, which ended none: `_PlainBatch`) takes
        `_advance_plain`, which checks the plain ones by the batch, not one by one."""
        plain, self._plain = self._plain, None
        if plain is not None and plain.seqs == seqs:  # (element by element, by identity)
            return self._advance_plain(plain, tokens, now)
        ended, with_grammar = self._advance(seqs, tokens, now)
        if not ended:
            self._plain = _PlainBatch.of(seqs)
        return ended, with_grammar

    def _advance_plain(
        self, plain: _PlainBatch, tokens: Seq[int], now: float
    ) -> tuple[dict[int, SequenceStatus], list[int]]:
        """`advance` for the sequences of the last advance, which ended none of them: since then each plain one
        (no grammar, stop strings, min_tokens or stop text) got exactly that advance's token, and its first
        token's time is set. Each plain one gets its token (in place of its placeholder, with async scheduling);
        those whose token is a stop id, found by one set test of the step's tokens, stop; those that reach their
        max_num_tokens (`margin`: none before the fewest tokens left is spent) end; the rest that make text are
        detokenized. The others (`plain.others`) take `_advance`, one by one."""
        seqs, others = plain.seqs, plain.others
        rows = plain.rows if others else range(len(seqs))
        if others:
            for i in rows:
                self._place(seqs[i], tokens[i])
        else:  # `_place`, inlined: this loop runs for every sequence of every steady step
            for seq, token in zip(seqs, tokens, strict=True):
                if seq.pending_row >= 0:  # its placeholder, last in token_ids (async scheduling)
                    seq.token_ids[-1] = token
                    seq.pending_row = -1
                else:
                    seq.token_ids.append(token)
        ended: dict[int, SequenceStatus] = {}
        if plain.stop_ids and not plain.stop_ids.isdisjoint(tokens):
            for i in rows:
                if tokens[i] in seqs[i].stop_ids:
                    ended[i] = SequenceStatus.FINISHED_STOPPED
        plain.margin -= 1  # each has a token more
        if plain.margin <= 0:
            for i in rows:
                if i not in ended and len(seqs[i].token_ids) >= seqs[i].max_num_tokens:
                    ended[i] = SequenceStatus.FINISHED_LENGTH
        if plain.to_decode:  # (a token that stops adds no text; the one that reaches the length does)
            stopped = {i for i, status in ended.items() if status == SequenceStatus.FINISHED_STOPPED}
            self.detokenize(
                plain.to_decode
                if not stopped
                else [seqs[i] for i in rows if i not in stopped and seqs[i].params.detokenize]
            )
        with_grammar: list[int] = []
        if others:
            their_ended, their_grammar = self._advance(
                [seqs[i] for i in others], [tokens[i] for i in others], now
            )
            for k, status in their_ended.items():
                ended[others[k]] = status
            with_grammar = [others[k] for k in their_grammar]
        if not ended:
            self._plain = plain  # the next step's are these again, if none ended
        return ended, with_grammar

    @staticmethod
    def _place(seq: Sequence, token: int) -> None:
        """`seq` gets `token`: in place of its placeholder (async scheduling), else after its tokens."""
        if seq.pending_row >= 0:
            seq.token_ids[-1] = token
            seq.pending_row = -1
        else:
            seq.token_ids.append(token)

    def _advance(
        self, seqs: Seq[Sequence], tokens: Seq[int], now: float
    ) -> tuple[dict[int, SequenceStatus], list[int]]:
        """`advance`, one sequence at a time."""
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


@dataclass(slots=True)
class _PlainBatch:
    """An advance's sequences, none ended by it, with what `_advance_plain` needs of those that are plain to
    stop (no grammar, no stop strings, no min_tokens, no stop text in the output: a stop id or the length ends
    them): their rows (`rows`; the others' in `others`), the union of their stop ids, the fewest tokens any has
    left before its max_num_tokens, and those whose text the engine makes (SamplingParams.detokenize)."""

    seqs: list[Sequence]
    rows: list[int]
    others: list[int]
    stop_ids: frozenset[int]
    margin: int
    to_decode: list[Sequence]

    @staticmethod
    def of(seqs: Seq[Sequence]) -> _PlainBatch | None:
        """The batch of `seqs`, or None if none is plain, one is not running, or one is there twice."""
        rows: list[int] = []
        others: list[int] = []
        live = SequenceStatus.RUNNING
        for i, seq in enumerate(seqs):
            p = seq.params
            if seq.status != live:
                return None
            if (
                p.json_schema is not None
                or p.stop
                or p.min_tokens
                or p.include_stop_str_in_output
                or seq.first_token_time is None
            ):
                others.append(i)
            else:
                rows.append(i)
        if not rows or len(set(map(id, seqs))) < len(seqs):
            return None
        plain = [seqs[i] for i in rows]
        return _PlainBatch(
            list(seqs),
            rows,
            others,
            frozenset().union(*map(_stop_ids, plain)),
            min(seq.max_num_tokens - len(seq.token_ids) for seq in plain),
            [seq for seq in plain if seq.params.detokenize],
        )


_stop_ids = attrgetter("stop_ids")
