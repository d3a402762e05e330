"""POST /v1/chat/completions and /v1/completions with the official `openai` client against the real stack
(the API under gunicorn's gthread workers, a real worker): the answer, streamed or not, is the offline
engine's greedy output for the same rendered prompt; a process holds at most COMPLETION_SLOTS waiting
calls (429 + Retry-After beyond); a streamed call whose client goes away cancels its job."""

from __future__ import annotations

import json
import threading
import time
import uuid

import jsonschema_rs
import openai
import pytest
import requests

from batching import SamplingParams
from batching.tokenizer import load_tokenizer
from tests.conftest import serve_api
from tests.workers.conftest import assert_streamed_as_made, generation_seconds, timed

CHAT = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "What comes after Tuesday?"},
]
LONG_CHAT = [CHAT[0], {"role": "user", "content": "What comes after 3?"}]  # greedy: no EOS in 1,500 tokens


def greedy(offline_engine, prompt, max_tokens: int, **params):
    [out] = offline_engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, **params))
    return out


def chat_prompt(messages=CHAT) -> list[int]:
    return load_tokenizer("tiny-llama").apply_chat_template(
        messages, add_generation_prompt=True, return_dict=True
    )["input_ids"]


def test_a_chat_completion_waits_for_its_job_and_answers_in_openai_shape(wide, openai_client, offline_engine):
    reply = openai_client.chat.completions.create(
        model="tiny-llama", messages=CHAT, max_tokens=12, temperature=0
    )
    want = greedy(offline_engine, chat_prompt(), 12)
    assert (
        reply.object == "chat.completion" and reply.model == "tiny-llama" and reply.id.startswith("chatcmpl-")
    )
    [choice] = reply.choices
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.finish_reason == want.finish_reason
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (
        len(chat_prompt()),
        len(want.token_ids),
    )
    job = wide.job(
        str(uuid.UUID(reply.id.removeprefix("chatcmpl-")))
    )  # a genq job like any other, priority 0
    assert job["status"] == "succeeded" and job["priority"] == 0 and job["output"]["text"] == want.text


def test_a_streamed_chat_completion_sends_the_text_as_it_comes(openai_client, offline_engine, api_url, wide):
    # 1,000 tokens: ~1 s on an idle machine, long enough for the engine's pace to show over the API's hops
    want = greedy(offline_engine, chat_prompt(LONG_CHAT), 1000)
    started = time.monotonic()
    stream = openai_client.chat.completions.create(
        messages=LONG_CHAT,
        model="tiny-llama",
        max_tokens=1000,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"priority": 3},
    )
    arrivals, chunks = zip(*timed(stream), strict=True)
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [
        (at, c.choices[0].delta.content)
        for at, c in zip(arrivals, chunks)
        if c.choices and c.choices[0].delta.content
    ]
    assert "".join(text for _, text in pieces) == want.text
    job_id = str(uuid.UUID(chunks[0].id.removeprefix("chatcmpl-")))
    made_s = generation_seconds(api_url, wide.headers, job_id)
    assert_streamed_as_made(started, [at for at, _ in pieces], made_s)  # in pieces, as the worker made them
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        want.finish_reason
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].object == "chat.completion.chunk"


def test_text_completions_streamed_or_not_with_a_stop_string(openai_client, offline_engine):
    prompt = "Once upon a time"
    plain = greedy(offline_engine, prompt, 60)
    stop = plain.text[20:23]  # cuts the text: the streamed pieces must not have sent past it
    want = greedy(offline_engine, prompt, 60, stop=[stop])
    assert want.finish_reason == "stop" and len(want.text) < len(plain.text)
    reply = openai_client.completions.create(
        model="tiny-llama", prompt=prompt, max_tokens=60, temperature=0, stop=[stop]
    )
    assert reply.object == "text_completion" and reply.choices[0].text == want.text
    assert reply.usage.prompt_tokens == len(want.prompt_token_ids)
    streamed = list(
        openai_client.completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=60, temperature=0, stop=[stop], stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == want.text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_bad_requests_name_the_field(openai_client):
    with pytest.raises(openai.BadRequestError) as bad:
        openai_client.chat.completions.create(model="tiny-llama", messages=CHAT, n=17)
    assert bad.value.body["param"] == "n" and "1 to 16" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        openai_client.chat.completions.create(model="tiny-llama", messages=CHAT, logit_bias={"1000": 2})
    assert bad.value.body["param"] == "logit_bias" and "outside the vocabulary" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        openai_client.completions.create(model="tiny-llama", prompt="x", max_tokens=5000)
    assert bad.value.body["param"] == "max_tokens" and "max_model_len" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        openai_client.chat.completions.create(model="tiny-llama", messages=CHAT, extra_body={"priority": 12})
    assert bad.value.body["param"] == "priority"
    with pytest.raises(openai.BadRequestError) as bad:
        openai_client.completions.create(model="tiny-llama", prompt="x", extra_body={"max_tokens": "8"})
    assert bad.value.body["param"] == "max_tokens" and "expected an integer" in bad.value.message
    with pytest.raises(
        openai.NotFoundError
    ) as unknown:  # OpenAI's answer (and vLLM's) for a model not served
        openai_client.chat.completions.create(model="gpt-4", messages=CHAT)
    assert unknown.value.body["code"] == "model_not_found" and "`tiny-llama`" in unknown.value.message


def test_waiting_calls_are_bounded_and_a_stream_left_behind_cancels_its_job(wide, new_key, offline_engine):
    """One gunicorn process with one slot: a second call while a stream holds the slot is a 429 with
    Retry-After; closing the stream early cancels its job and frees the slot."""
    key = new_key()
    with serve_api(wide.settings, workers=1, env={"COMPLETION_SLOTS": "1"}) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
        long = client.chat.completions.create(
            model="tiny-llama",
            messages=LONG_CHAT,
            max_tokens=1500,
            temperature=0,
            stop=["never-seen-stop"],
            stream=True,
        )
        first = next(iter(long))  # the call is under way: it holds the process's slot
        job_id = str(uuid.UUID(first.id.removeprefix("chatcmpl-")))
        with pytest.raises(openai.RateLimitError) as refused:
            client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=2)
        assert refused.value.response.headers["Retry-After"] == "1"
        assert "COMPLETION_SLOTS" in refused.value.message
        headers = {"Authorization": f"Bearer {key}"}
        assert requests.get(f"{url}/jobs/{job_id}", headers=headers, timeout=10).json()["status"] in (
            "queued",
            "running",
        )
        long.close()  # the client goes away mid-stream
        deadline = time.monotonic() + 30
        while (job := requests.get(f"{url}/jobs/{job_id}", headers=headers, timeout=10).json())["status"] != (
            "cancelled"
        ):
            assert time.monotonic() < deadline, job
            time.sleep(0.2)
        assert job["usage"]["completion_tokens"] < 1500
        # the slot is free again: a quick call goes through
        reply = client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=3, temperature=0)
        assert reply.choices[0].message.content == greedy(offline_engine, chat_prompt(), 3).text


def test_a_sync_gunicorn_worker_turns_completions_off_and_keeps_jobs(wide, new_key):
    key = new_key()
    with serve_api(wide.settings, workers=1, env={"API_WORKER_CLASS": "sync"}) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)
        with pytest.raises(openai.InternalServerError) as off:
            client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=2)
        assert off.value.status_code == 503 and "COMPLETION_SLOTS=0" in off.value.message
        r = requests.post(
            f"{url}/jobs", json={"prompt": "hi", "max_tokens": 2}, headers={"Authorization": f"Bearer {key}"}
        )
        assert r.status_code == 202


def test_concurrent_calls_all_answer(openai_client, offline_engine):
    """More calls at once than one process's slots, over the two processes: the ones refused retry (as
    OpenAI's openai_client does on a 429) and every answer is right."""
    results: dict[int, str] = {}

    def call(i: int) -> None:
        retrying = openai_client.with_options(max_retries=8)
        reply = retrying.chat.completions.create(
            model="tiny-llama", messages=CHAT, max_tokens=4 + i % 3, temperature=0
        )
        results[i] = reply.choices[0].message.content

    threads = [threading.Thread(target=call, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results) == list(range(10))
    for i, text in results.items():
        assert text == greedy(offline_engine, chat_prompt(), 4 + i % 3).text


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "smart": {"type": "boolean"},
    },
    "required": ["name", "age", "smart"],
    "additionalProperties": False,
}


def test_response_format_constrains_the_output_to_json(openai_client, offline_engine):
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    want = greedy(offline_engine, chat_prompt(), 80, json_schema=json.dumps(PERSON))
    reply = openai_client.chat.completions.create(
        model="tiny-llama", messages=CHAT, max_tokens=80, temperature=0, response_format=schema_format
    )
    [choice] = reply.choices
    assert choice.message.content == want.text and choice.finish_reason == "stop"
    assert jsonschema_rs.is_valid(PERSON, json.loads(choice.message.content))
    streamed = openai_client.chat.completions.create(
        model="tiny-llama",
        messages=CHAT,
        max_tokens=80,
        temperature=0.9,
        seed=5,
        response_format=schema_format,
        stream=True,
    )
    chunks = list(streamed)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert jsonschema_rs.is_valid(PERSON, json.loads(text)) and chunks[-1].choices[0].finish_reason == "stop"
    reply = openai_client.completions.create(
        model="tiny-llama",
        prompt="Once",
        max_tokens=200,
        temperature=0,
        extra_body={
            "response_format": {"type": "json_object"}
        },  # not in the client's completions: vLLM's way
    )
    object_want = greedy(offline_engine, "Once", 200, json_schema='{"type": "object"}')
    assert reply.choices[0].text == object_want.text and reply.choices[0].text.startswith("{")
    for bad_format in (
        {"type": "xml"},
        {"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}},
    ):
        with pytest.raises(openai.BadRequestError) as bad:
            openai_client.chat.completions.create(
                model="tiny-llama", messages=CHAT, response_format=bad_format
            )
        assert bad.value.body["param"] == "response_format", bad.value.body


def test_a_streamed_call_of_several_choices_left_behind_cancels_every_job(wide, openai_client):
    """n > 1 streamed: the client going away mid-stream cancels each choice's job."""
    stream = openai_client.chat.completions.create(
        model="tiny-llama",
        messages=LONG_CHAT,
        max_tokens=1500,
        temperature=0,
        stop=["never-seen-stop"],
        n=2,
        stream=True,
    )
    first = next(iter(stream))
    assert first.choices[0].index in (0, 1)
    response = stream.response
    stream.close()
    response.close()
    deadline = time.monotonic() + 30
    cancelled = set()
    since = time.monotonic()
    while len(cancelled) < 2:  # the call's jobs: the newest two of this tenant
        jobs = wide.client.get("/jobs", query_string={"limit": 2}, headers=wide.headers).json["jobs"]
        cancelled = {j["id"] for j in jobs if j["status"] == "cancelled"}
        assert time.monotonic() < deadline, (jobs, time.monotonic() - since)
        time.sleep(0.2)
    assert all(j["usage"]["completion_tokens"] < 1500 for j in jobs)
