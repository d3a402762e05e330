"""The step's detokenizer: its one-call path over the Rust tokenizer gives, token by token, exactly the text that
`tokenizer.decode` windows give (the path every other tokenizer takes), for byte-level BPE (multi-byte
characters split across tokens) and sentencepiece-style Metaspace tokenizers (a leading space that depends on
the token before), with and without special tokens skipped, many sequences in one call."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from batching.detokenizer import Detokenizer
from batching.sampling_params import SamplingParams
from batching.sequence import Sequence

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Ünïcödé: naïve café, 東京, emoji 🙂🚀, and more.",
    "Once upon a time, in a land far away, there lived a small tokenizer that merged bytes into words.",
    "def main():\n    print('hello, world')  # a comment\n\treturn 0\n",
] * 20
SPECIALS = ["<unk>", "<s>", "</s>"]


def byte_level_bpe() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def metaspace_bpe() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=SPECIALS + byte_tokens)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


TOKENIZERS = {"byte-level": byte_level_bpe, "metaspace": metaspace_bpe}


def sequences(tokenizer, skip: bool, n: int, seed: int) -> tuple[list[Sequence], list[list[int]]]:
    """n sequences with a short prompt, and the output tokens each will get: half of them real text's tokens
    (cut anywhere, specials mixed in), half random ids (broken characters, lone byte tokens)."""
    rng = random.Random(seed)
    vocab = len(tokenizer)
    seqs, outputs = [], []
    for i in range(n):
        prompt = tokenizer.encode(rng.choice(CORPUS)[: rng.randint(3, 20)])
        if i % 2:
            text = rng.choice(CORPUS)
            start = rng.randrange(len(text) - 40)
            out = tokenizer.encode(text[start : start + 60])
            for _ in range(3):
                out.insert(rng.randrange(len(out)), rng.randrange(len(SPECIALS)))
        else:
            out = [rng.randrange(vocab) for _ in range(40)]
        seqs.append(Sequence(f"s{i}", prompt, SamplingParams(skip_special_tokens=skip), 5, 0))
        outputs.append(out)
    return seqs, outputs


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_one_call_path_gives_what_decode_windows_give(name, skip):
    tokenizer = TOKENIZERS[name]()
    fast = Detokenizer(tokenizer)
    assert fast.backend is not None, "a plain fast tokenizer takes the Rust path"
    slow = Detokenizer(tokenizer)
    slow.backend = None  # tokenizer.decode, a window at a time
    fast_seqs, outputs = sequences(tokenizer, skip, 24, seed=len(name) + skip)
    slow_seqs, _ = sequences(tokenizer, skip, 24, seed=len(name) + skip)
    for step in range(max(map(len, outputs))):
        moving = [i for i, out in enumerate(outputs) if step < len(out)]
        for i in moving:
            fast_seqs[i].token_ids.append(outputs[i][step])
            slow_seqs[i].token_ids.append(outputs[i][step])
        fast([fast_seqs[i] for i in moving])
        slow([slow_seqs[i] for i in moving])
        for i in moving:
            f, s = fast_seqs[i], slow_seqs[i]
            assert (f.text, f.prefix_offset, f.read_offset) == (s.text, s.prefix_offset, s.read_offset), (
                f"sequence {i} after step {step}"
            )
    # text cut from real text comes out whole once its last character is complete
    for i in range(1, len(outputs), 2):
        whole = tokenizer.decode(outputs[i], skip_special_tokens=skip)
        if not whole.endswith("\ufffd"):
            assert fast_seqs[i].text == whole


def test_tokenizers_that_change_decoding_take_their_own_decode():
    tokenizer = byte_level_bpe()
    tokenizer.clean_up_tokenization_spaces = True  # transformers edits the Rust decoder's text
    assert Detokenizer(tokenizer).backend is None

    class OwnDecode(PreTrainedTokenizerFast):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    own = OwnDecode(tokenizer_object=byte_level_bpe()._tokenizer, eos_token="</s>")
    detokenize = Detokenizer(own)
    assert detokenize.backend is None
    seq = Sequence("s", own.encode("hi"), SamplingParams(), 5, 0)
    for token in own.encode("hello there"):
        seq.token_ids.append(token)
        detokenize([seq])
    assert seq.text == "HELLO THERE"
