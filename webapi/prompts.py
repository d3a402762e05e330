"""Prompts from requests: chat messages rendered with the model's own chat template, token counts, and the
model's length limit. POST /jobs and the Batch API both go through here, one request or thousands at once.

Chat messages become token ids with `tokenizer.apply_chat_template(..., add_generation_prompt=True)`,
stored as the job's `input_ids`, so the engine runs exactly what the template made (a rendered text
tokenized again could gain a second BOS). A conversation whose text contains a special token's text
(`<|im_start|>`, `</s>`, ...) is rendered with `sanitize_control_tokens=True`: its writer gets those
characters as text, never the control token. The others (nearly all) are rendered and tokenized in one
batched call, as apply_chat_template does by default: sanitizing costs twice the time, and changes
nothing where there is nothing to sanitize but where a message's edges fall between tokens.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from jinja2 import TemplateError

from webapi.errors import APIError


@dataclass(frozen=True, slots=True)
class PromptError:
    """Why one request's prompt cannot run: the field, and a message naming the limit."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class NoChatTemplate(ValueError):
    """The model has no chat template, so `messages` cannot be rendered."""


def tokenizer_for(model: str):
    """The model's tokenizer (loaded once per process; no model weights), or None if it ships none; 503
    tokenizer_unavailable when it cannot be loaded here (a checkpoint a worker announces, absent on the API's
    host): the request is not at fault, and another API host, or this one once the files are there, takes it."""
    from batching.tokenizer import load_tokenizer  # imports no model code

    try:
        return load_tokenizer(model)
    except ValueError as exc:
        raise APIError(
            503,
            "tokenizer_unavailable",
            f"the API cannot load the tokenizer of {model!r} to check this request ({exc}); the API's host "
            "needs the model's tokenizer files (or access to the Hugging Face Hub)",
            {"Retry-After": "30"},
            param=None,
        ) from None


@lru_cache(maxsize=8)
def vocab_size(model: str) -> int | None:
    """Token ids the model's tokenizer knows (ids are below it), or None without a tokenizer."""
    tokenizer = tokenizer_for(model)
    return None if tokenizer is None else len(tokenizer)


def warm_up(model: str) -> None:
    """Load the model's tokenizer and compile its chat template now (an API process calls this as it
    starts), so that the first request, or a 10,000-line batch, does not pay for them."""
    tokenizer = tokenizer_for(model)
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        render_chats(tokenizer, model, [[{"role": "user", "content": "hello"}]])


def render_chats(tokenizer, model: str, conversations: Sequence[list[dict]]) -> list[list[int] | PromptError]:
    """Token ids of each conversation with the assistant's turn opened, or the template's refusal."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplate(
            f"messages: the model {model} has no chat template; send `prompt` (text you rendered yourself) "
            "or `input_ids` instead"
        )
    special = _special_text(tokenizer)
    hostile = [any(special.search(m["content"] + m.get("name", "")) for m in c) for c in conversations]
    rendered: list[list[int] | PromptError | None] = [None] * len(conversations)
    for sanitize in (False, True):
        picked = [i for i, h in enumerate(hostile) if h == sanitize]
        if not picked:
            continue
        try:
            outs = _apply(tokenizer, [conversations[i] for i in picked], sanitize)
        except TemplateError:  # one conversation refused (e.g. roles out of order): find which, one at a time
            outs = [_render_one(tokenizer, conversations[i], sanitize) for i in picked]
        for i, out in zip(picked, outs, strict=True):
            rendered[i] = out
    return rendered


@lru_cache(maxsize=8)
def _special_text(tokenizer) -> re.Pattern:
    """Matches the text of any of the tokenizer's added (control) tokens."""
    texts = sorted(
        {t.content for t in tokenizer.added_tokens_decoder.values() if t.content}, key=len, reverse=True
    )
    return re.compile("|".join(map(re.escape, texts)) or "(?!)")


def _render_one(tokenizer, conversation: list[dict], sanitize: bool) -> list[int] | PromptError:
    try:
        return _apply(tokenizer, [conversation], sanitize)[0]
    except TemplateError as exc:
        return PromptError("messages", f"the model's chat template refused them: {exc}")


def _apply(tokenizer, conversations: list[list[dict]], sanitize: bool) -> list[list[int]]:
    if sanitize or not _plain_backend(tokenizer):
        out = tokenizer.apply_chat_template(
            conversations, add_generation_prompt=True, return_dict=True, sanitize_control_tokens=sanitize
        )
        return out["input_ids"]
    # what apply_chat_template(tokenize=True) does, in two steps: render the texts, then encode them as
    # it would (no special tokens added), straight with the Rust tokenizer: a third of the time
    texts = tokenizer.apply_chat_template(conversations, add_generation_prompt=True, tokenize=False)
    return encode_texts(tokenizer, texts, add_special_tokens=False)


def encode_texts(tokenizer, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
    """Token ids of each text, as `tokenizer(texts, add_special_tokens=...)["input_ids"]` gives them.

    For a plain fast tokenizer that call is the Rust tokenizer's encode_batch plus a Python layer that
    builds offsets, masks and a BatchEncoding: at 10,000 prompts a batch, more time than the encoding
    itself. encode_batch_fast returns the same ids without offsets (tests/webapi/test_chat.py checks)."""
    if not _plain_backend(tokenizer):
        return tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
    encodings = tokenizer.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)
    return [encoding.ids for encoding in encodings]


def _plain_backend(tokenizer) -> bool:
    """Whether `tokenizer(...)` is transformers' plain call into its Rust tokenizer: a TokenizersBackend
    whose encoding no subclass changes, with no truncation or padding set, splitting special tokens as
    the Rust tokenizer is set to."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    if not isinstance(tokenizer, TokenizersBackend):
        return False
    kind = type(tokenizer)
    if (
        kind._encode_plus is not TokenizersBackend._encode_plus
        or kind.__call__ is not TokenizersBackend.__call__
    ):
        return False
    backend = tokenizer.backend_tokenizer
    return (
        backend.truncation is None
        and backend.padding is None
        and backend.encode_special_tokens == bool(tokenizer.split_special_tokens)
    )


def count_texts(tokenizer, model: str, texts: Sequence[str]) -> list[int]:
    """Prompt tokens of each text prompt, as the engine will encode it (special tokens such as BOS added)."""
    if tokenizer is None:
        raise NoChatTemplate(f"prompt: the model {model} has no tokenizer; send token ids instead")
    if not texts:
        return []
    return [len(ids) for ids in encode_texts(tokenizer, list(texts))]


def prepare_prompt(
    model: str,
    messages: list[dict] | None = None,
    input_ids: Sequence[int] | None = None,
    text: str | None = None,
) -> tuple[list[int] | None, int, PromptError | None]:
    """One request's prompt, the first of `messages` / `input_ids` / `text` given, as its job stores it:
    token ids (a chat rendered with the model's template, or the ids sent) or None for a text (the engine
    encodes it), its token count, and why it cannot run (None if it can). Raises NoChatTemplate."""
    tokenizer = tokenizer_for(model)
    if messages is not None:
        [ids] = render_chats(tokenizer, model, [messages])
        return (None, 0, ids) if isinstance(ids, PromptError) else (ids, len(ids), None)
    if input_ids is not None:
        return list(input_ids), len(input_ids), check_token_ids(input_ids, tokenizer, model)
    [count] = count_texts(tokenizer, model, [text or ""])
    return None, count, None


def check_length(
    prompt_tokens: int,
    max_tokens: int,
    max_model_len: int,
    prompt_field: str,
    max_tokens_field: str = "max_tokens",
    defaulted: bool = False,
) -> PromptError | None:
    """None if prompt tokens + max_tokens fit the model, else the error naming the field at fault: the
    prompt when it leaves no room for one token, else max_tokens (`defaulted`: the caller left it out)."""
    if prompt_tokens + max_tokens <= max_model_len:
        return None
    limit = f"max_model_len {max_model_len} (MAX_MODEL_LEN)"
    if prompt_tokens >= max_model_len:
        return PromptError(
            prompt_field,
            f"prompt too long for the model: its {prompt_tokens} tokens leave no room to generate within {limit}",
        )
    asked = f"{max_tokens}{' (the default)' if defaulted else ''}"
    return PromptError(
        max_tokens_field,
        f"{asked} tokens to generate + {prompt_tokens} prompt tokens is more than {limit}; with this prompt, "
        f"ask for at most {max_model_len - prompt_tokens}",
    )


def check_token_ids(input_ids: Sequence[int], tokenizer, model: str) -> PromptError | None:
    """None if every id is in the model's vocabulary."""
    if tokenizer is not None and input_ids and max(input_ids) >= len(tokenizer):
        return PromptError(
            "input_ids", f"token ids must be below {len(tokenizer)}, the vocabulary size of {model}"
        )
    return None
