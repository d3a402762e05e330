"""Tokenizers: the built-in byte-level one for tiny-llama, or the model's own from the Hub / a path.

Imports no model code, so the API can count prompt tokens without loading torch models.
"""

from __future__ import annotations

import os
from functools import lru_cache

BUILTIN_MODEL = "tiny-llama"
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2; bytes follow from id 3
BOS_ID, EOS_ID = 1, 2
# tiny-llama's chat template: small, so chat requests (`messages`) can be tested end to end without a real
# instruct model. Each message is `<|role|>` and its content on lines of their own, then `</s>`.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def byte_level_tokenizer(merges: list[tuple[str, str]] | None = None):
    """One token per byte (259 ids), BOS added; round-trips any UTF-8 text; a small chat template. Built
    locally, no download. `merges` (byte-level BPE pairs, e.g. ("Ġ", "t")) add a token each after the bytes:
    a tokenizer of another vocabulary, for tests of a second model."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel's alphabet is a set; order it by the byte each character stands for
    ordered = sorted(byte_chars, key=_byte_of_char)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(ordered)})
    for left, right in merges or []:
        vocab[left + right] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges or [], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", BOS_ID)]
    )
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<unk>",
        chat_template=TINY_CHAT_TEMPLATE,
    )


def _byte_of_char(ch: str) -> int:
    """Inverse of GPT-2's bytes_to_unicode for one character."""
    code = ord(ch)
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


@lru_cache(maxsize=8)
def load_tokenizer(model: str, revision: str | None = None, trust_remote_code: bool = False):
    """The tokenizer for `model`, or None for a local checkpoint that ships none (token-id prompts only)."""
    if model == BUILTIN_MODEL:
        return byte_level_tokenizer()
    from transformers import AutoTokenizer

    if os.path.isdir(model) and not any(
        os.path.exists(os.path.join(model, f))
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        return None
    try:
        return AutoTokenizer.from_pretrained(model, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ValueError(f"model: cannot load a tokenizer for {model!r}: {exc}") from exc
