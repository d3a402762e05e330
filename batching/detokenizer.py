"""Incremental detokenization of a step's sequences, in one pass over all of them.

Each sequence keeps a window of its tokens (prefix_offset..): the text of the window's known part
(prefix_offset..read_offset) is decoded, and so is the whole window; what the whole adds beyond the
known part is the new text, unless it ends mid-character (U+FFFD), in which case the token waits for
the next one. Decoding a window, not a token, keeps tokenizers that merge across token boundaries
(leading spaces, byte fallback) right: the same rule as vLLM's and transformers' streamers.

Cost: a tokenizer backed by the Rust `tokenizers` library (every "fast" tokenizer) is called directly,
skipping transformers' Python wrapper (which converts each list element by element: 2.2 against 0.4 us a
window), one window at a time in this thread (its `decode_batch` hands windows to a thread pool that
competes with torch's for the cores: a step of 256 took 0.3 ms more wall time that way). The known part is
nearly always one token (the last step's), whose text is looked up in a per-token table instead of decoded
again; with byte-level BPE's decoder (`_byte_level`) the window's text is then the two tokens' texts from that
table, and no decode runs at all (a Rust call costs ~0.7 us, two look-ups ~0.1). A tokenizer with a
decode of its own (a slow tokenizer, a subclass, clean-up of tokenization spaces) is called as before,
one window at a time, so the text is always what `tokenizer.decode` gives.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from batching.sequence import Sequence


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer  # None: token ids only, no text
        self.backend = _rust_backend(tokenizer)
        # its decode joins the tokens' bytes and reads them as UTF-8 (see the module's docstring)
        self.byte_level = _byte_level(self.backend)
        # the text of a one-token window, by skip_special_tokens then token id (filled as met); and, of those,
        # the texts that are whole characters (not empty, no U+FFFD): the common token's, byte-level
        self._single: dict[bool, dict[int, str]] = {False: {}, True: {}}
        self._whole: dict[bool, dict[int, str]] = {False: {}, True: {}}

    def __call__(self, seqs: Seq[Sequence] | Seq[OutputText]) -> None:
        """Append to each sequence's text what its tokens past read_offset add (appended already); a sequence
        whose params say detokenize=False is left as it is."""
        if self.tokenizer is None or not seqs:
            return
        if self.backend is None:
            for seq in seqs:
                if seq.params.detokenize:
                    self._one(seq)
            return
        # one pass, every step's sequences: the loop below is the engine's per-token cost, kept flat
        decode, singles, wholes, byte_level = self.backend.decode, self._single, self._whole, self.byte_level
        for seq in seqs:
            p = seq.params
            if not p.detokenize:  # its text is made elsewhere, from its token ids (OutputText)
                continue
            ids = seq.token_ids
            start, read = seq.prefix_offset, seq.read_offset
            skip = p.skip_special_tokens
            if byte_level and read - start == 1 and len(ids) == read + 1:
                # the common window: the last step's token a (known) and this one's, b. Byte-level, a's text
                # without U+FFFD is whole characters, so the window's is a's text + b's: b's from the table
                whole = wholes[skip]
                a, b = ids[start], ids[read]
                piece = whole.get(b)
                if piece is not None and a in whole:  # both whole characters (the common case): one look-up
                    seq.text += piece
                    seq.prefix_offset, seq.read_offset = read, read + 1
                    continue
                single = singles[skip]
                prefix = single.get(a)
                if prefix is None:
                    prefix = self._learn(a, skip)
                if "\ufffd" not in prefix:
                    piece = single.get(b)
                    if piece is None:
                        piece = self._learn(b, skip)
                    if piece and piece[-1] != "\ufffd":
                        seq.text += piece
                        seq.prefix_offset, seq.read_offset = read, read + 1
                    continue
            window = ids[start:]
            known = read - start
            if known == 1:  # the last step's token: its text from the table
                prefix = singles[skip].get(window[0])
                if prefix is None:
                    prefix = self._learn(window[0], skip)
            elif known == 0:
                prefix = ""
            else:
                prefix = decode(window[:known], skip)
            full = decode(window, skip)
            # what the window adds beyond its known part joins the text and the window moves on, unless it
            # ends mid-character (it waits for the next token): _advance, inline
            if len(full) > len(prefix) and full[-1] != "\ufffd":
                seq.text += full[len(prefix) :]
                seq.prefix_offset, seq.read_offset = read, len(ids)

    def _learn(self, token: int, skip: bool) -> str:
        """The text of `token` alone, decoded once and kept in the tables."""
        assert self.backend is not None
        text = self._single[skip][token] = self.backend.decode([token], skip)
        if text and "\ufffd" not in text:
            self._whole[skip][token] = text
        return text

    def _one(self, seq: Sequence | OutputText) -> None:
        ids, skip, decode = seq.token_ids, seq.params.skip_special_tokens, self.tokenizer.decode
        prefix = decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip)
        _advance(seq, prefix, decode(ids[seq.prefix_offset :], skip_special_tokens=skip))


def _advance(seq: Sequence | OutputText, prefix: str, full: str) -> None:
    """What the window's text `full` adds beyond its known part `prefix` joins the sequence's text, and the
    window moves on; unless it ends mid-character (it waits for the next token)."""
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        seq.text += full[len(prefix) :]
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(seq.token_ids)


def _byte_level(backend) -> bool:
    """Whether the Rust tokenizer's decoder is byte-level BPE's alone (GPT-2's, Llama 3's, Qwen's): its text of
    tokens is their bytes (an added token's: its text's), joined, read as UTF-8 with U+FFFD for what is not.
    Then the text of [a, b], when a's own text has no U+FFFD (its bytes end a character), is a's text + b's:
    UTF-8 resynchronizes at a character's end."""
    if backend is None:
        return False
    from tokenizers import decoders

    return isinstance(backend.decoder, decoders.ByteLevel)


def _rust_backend(tokenizer):
    """The `tokenizers.Tokenizer` whose decode is exactly `tokenizer.decode`, or None: a fast tokenizer
    whose decoding transformers does not change (no decode of its own, no clean-up of spaces)."""
    if tokenizer is None:
        return None
    try:
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    cls = type(tokenizer)
    if (
        isinstance(backend, Tokenizer)
        and isinstance(tokenizer, PreTrainedTokenizerFast)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is PreTrainedTokenizerFast._decode
        and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
    ):
        return backend
    return None


class OutputText:
    """One request's text made outside the engine, from the rows the engine reports of it (step_deltas's, with
    SamplingParams(detokenize=False): token ids, no text): the same text, row for row, as the engine would
    have made and reported, because it is made by the same Detokenizer, called at the same points.

    The engine detokenizes a sequence once per step in which it got a sampled token (stopping.py), after
    appending it: `take` does the same with each row. A row that carries tokens but no sampled one of this
    step (an abort: its tokens, if any, are resumed ones never reported) makes no text, and neither does the
    token that ended the request with "stop" (an end of sequence or stop token id: no text unless
    include_stop_str_in_output). That last rule needs "stop" to mean a stop token: a request with stop strings
    or a grammar (json_schema, which stops after a token with text) keeps its text in the engine. Without
    stop strings nothing is held back, so each row's text is all that is new (as step_deltas.report's).

    The window's offsets count output tokens (the engine's count prompt + output: the window starts after the
    prompt either way), so no prompt is needed; a resumed request's first row holds its resumed tokens too and
    the text of all of them, as the engine's does."""

    __slots__ = ("params", "token_ids", "prefix_offset", "read_offset", "text")

    def __init__(self, params):
        self.params = params  # its SamplingParams as the caller made them (detokenize True)
        self.token_ids: list[int] = []
        self.prefix_offset = self.read_offset = 0
        self.text = ""

    def take(self, token_ids: list[int], finish_reason: str | None) -> bool:
        """Append a row's tokens; whether the engine would have detokenized after them (then call the
        Detokenizer with it, once per step, with the step's others)."""
        self.token_ids += token_ids
        if finish_reason is None or finish_reason == "length":
            return bool(token_ids)
        return finish_reason == "stop" and self.params.include_stop_str_in_output
