"""OpenAI's streamed chunks of one choice of a completion (chat.completion.chunk or text_completion), rendered
from a follower's deltas (webapi/following.py): one chunk per engine step, as vLLM sends them.

A step's text alone is nearly every chunk of a stream: it is rendered from a template made once per stream
(the chunk's bytes before and after its text), the text JSON-escaped into it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]

from contract.deltas import Delta
from contract.logprob_shapes import chat_logprobs, completion_logprobs
from jobstore.batch_output import echoed_prompt
from jobstore.models import Job
from webapi.openai_schemas import CHAT_ENDPOINT
from webapi.prompts import tokenizer_for

DONE = b"data: [DONE]\n\n"

_MARK = "\x00genq-text\x00"  # stands for the text while a text chunk's template is rendered


class Chunks:
    """The events of one choice of a streamed completion (its `index`: several choices of a call share the
    `id` of the first's job), in OpenAI's chunk shapes."""

    def __init__(
        self,
        endpoint: str,
        model: str,
        job_id: uuid.UUID,
        job: Job,
        index: int = 0,
        checkpoint: str | None = None,
    ):
        """`model`: the name replies give; `checkpoint`: what its tokenizer is loaded from (None: `model`)."""
        self.chat = endpoint == CHAT_ENDPOINT
        self.job, self.index = job, index
        self.model = checkpoint or model  # tokenizer_for's key
        self.text_offset = 0  # completions' logprobs: characters of the token strings sent
        options = job.options or {}
        self.echo, self.alone = options.get("echo", False), options.get("echo_only", False)
        self.tokenizer = tokenizer_for(self.model) if options.get("logprobs") is not None else None
        self.base = {
            "id": ("chatcmpl-" if self.chat else "cmpl-") + job_id.hex,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": int(time.time()),
            "model": model,
        }
        self._text_template: tuple[bytes, bytes] | None = None  # a text chunk's bytes around its text

    def opening(self) -> Iterator[bytes]:
        """What a choice begins with: chat's role; an echoed prompt (the first chunk carries it, as vLLM's;
        with logprobs, it waits for the first step's event, which brings the prompt's)."""
        if self.chat:
            yield self.event(delta={"role": "assistant", "content": ""})
        elif self.echo and self.tokenizer is None:
            yield self.text(echoed_prompt(self.job, tokenizer_for(self.model)))
            self.echo = False

    def step(self, item: Delta) -> Iterator[bytes]:
        """One step's chunk (its text may be empty: a character not complete yet), as vLLM sends one a step,
        and the choice's finish. With `echo_only` (max_tokens 0) the token drawn is left out."""
        if self.echo and not self.chat:  # the echoed prompt with its log probabilities (null if missed)
            self.echo = False
            prompt = (item.fields or {}).get("prompt_logprobs")
            text = echoed_prompt(self.job, tokenizer_for(self.model))
            yield self.text(text, prompt and self.logprobs(prompt, self.tokenizer))
        logprobs = (item.fields or {}).get("logprobs") if self.tokenizer is not None else None
        if not self.alone and (item.token_ids and (not item.finish_reason or logprobs) or item.text):
            yield self.text(item.text, logprobs and self.logprobs(logprobs, self.tokenizer))
        if item.finish_reason in ("stop", "length"):
            yield self.finish("length" if self.alone else item.finish_reason)

    def plain_step(self, item: Delta) -> bytes | None:
        """What step() writes for a step without a finish that is only text (b"": nothing), or None when the
        step needs step() itself (an echo to send, log probabilities, fields, echo_only)."""
        if item.fields is not None or self.echo or self.tokenizer is not None or self.alone:
            return None
        return self.text(item.text) if item.token_ids or item.text else b""

    def completion_tokens(self, item: Delta) -> int:
        return 0 if self.alone else item.start + len(item.token_ids)

    def event(
        self,
        *,
        delta: dict | None = None,
        text: str = "",
        finish_reason: str | None = None,
        logprobs: dict | None = None,
    ) -> bytes:
        if self.chat:
            choice = {
                "index": self.index,
                "delta": delta or {},
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        else:
            choice = {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._data(dict(self.base, choices=[choice]))

    def text(self, text: str, logprobs: dict | None = None) -> bytes:
        if logprobs is None:  # a step's text alone, the chunk of nearly every event: from a template
            if self._text_template is None:
                marked = self.event(delta={"content": _MARK}, text=_MARK)
                head, _, tail = marked.partition(json.dumps(_MARK).encode())
                self._text_template = (head, tail)
            head, tail = self._text_template
            return head + encode_basestring_ascii(text).encode() + tail  # json.dumps(text)'s C core
        return self.event(delta={"content": text}, text=text, logprobs=logprobs)

    def logprobs(self, entries: list, tokenizer) -> dict:
        """The log probabilities of a step's tokens, in the endpoint's shape (completions: text offsets
        counted over the token strings so far, as in the reply that does not stream)."""
        if self.chat:
            return chat_logprobs(entries, tokenizer)
        shaped = completion_logprobs(entries, tokenizer, self.text_offset)
        self.text_offset += sum(map(len, shaped["tokens"]))
        return shaped

    def finish(self, finish_reason: str | None) -> bytes:
        return self.event(finish_reason=finish_reason)

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        return self._data(dict(self.base, choices=[], usage=usage))

    def error(self, code: str, message: str) -> bytes:
        return self._data(
            {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
        )

    @staticmethod
    def _data(payload: dict) -> bytes:
        return b"data: " + json.dumps(payload).encode() + b"\n\n"
