"""A streamed completion's text chunk is rendered from a per-stream template (webapi/completion_chunks.py):
the bytes must equal the chunk rendered whole, for both endpoints and any text."""

from __future__ import annotations

import json
import uuid
from types import SimpleNamespace

import pytest

from webapi.completion_chunks import Chunks
from webapi.openai_schemas import CHAT_ENDPOINT

TEXTS = ["hi", "", ' a "quoted" \\ back\nslash', "\x00genq-text\x00", "é€😀", "\u2028"]


@pytest.mark.parametrize("endpoint", ["/v1/completions", CHAT_ENDPOINT])
def test_a_text_chunk_from_the_template_equals_the_chunk_rendered_whole(endpoint):
    job_id = uuid.uuid4()
    chunks = Chunks(endpoint, "tiny-llama", job_id, SimpleNamespace(id=job_id, options={}), index=2)
    for text in TEXTS * 2:  # the second round reuses the template
        fast = chunks.text(text)
        assert fast == chunks.event(delta={"content": text}, text=text)
        payload = json.loads(fast.removeprefix(b"data: "))
        [choice] = payload["choices"]
        assert choice["index"] == 2
        assert (choice["delta"]["content"] if endpoint == CHAT_ENDPOINT else choice["text"]) == text
