"""The Batch API with the official `openai` client against the real stack: the API under gunicorn, a real
worker, Postgres and Redis. A batch runs to `completed` and every output line is what the offline engine
gives for the same rendered prompt; a batch is cancelled mid-run; a malformed file fails validation; another
tenant sees nothing."""

from __future__ import annotations

import json
import time

import openai
import pytest
import requests
from sqlalchemy import text

from batching import SamplingParams
from batching.tokenizer import load_tokenizer
from tests.conftest import serve_api
from workers.reconciler import expire_batches

TERMINAL = ("completed", "failed", "cancelled", "expired")


def client_for(api_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api_url}/v1", api_key=key, max_retries=0, timeout=60)


def jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def wait_for_batch(client: openai.OpenAI, batch_id: str, until=TERMINAL, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout}s")


def conversation(i: int) -> list[dict]:
    return [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": f"What comes after {i}?"},
    ]


def test_a_chat_batch_completes_with_the_offline_engines_greedy_output(wide, api_url, offline_engine):
    client = client_for(api_url, wide.headers["Authorization"].split()[1])
    lines = [
        {
            "custom_id": f"q{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "tiny-llama",
                "messages": conversation(i),
                "max_tokens": 6 + i % 7,
                "temperature": 0,
            },
        }
        for i in range(16)
    ]
    file = client.files.create(file=("questions.jsonl", jsonl(lines)), purpose="batch")
    assert file.bytes == len(jsonl(lines)) and file.purpose == "batch"
    batch = client.batches.create(
        input_file_id=file.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"priority": "3"},
    )
    assert batch.status == "in_progress" and batch.request_counts.total == 16
    done = wait_for_batch(client, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (
        16,
        0,
    ) and done.error_file_id is None
    output = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]

    tokenizer = load_tokenizer("tiny-llama")
    prompts = [
        tokenizer.apply_chat_template(conversation(i), add_generation_prompt=True, return_dict=True)[
            "input_ids"
        ]
        for i in range(16)
    ]
    params = [SamplingParams(max_tokens=line["body"]["max_tokens"], temperature=0) for line in lines]
    expected = offline_engine.generate(prompts, params)
    assert [line["custom_id"] for line in output] == [f"q{i}" for i in range(16)]  # every line, once
    for line, prompt, want in zip(output, prompts, expected, strict=True):
        body = line["response"]["body"]
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert body["object"] == "chat.completion" and body["model"] == "tiny-llama"
        assert body["choices"][0]["message"] == {"role": "assistant", "content": want.text}, line["custom_id"]
        assert body["choices"][0]["finish_reason"] == want.finish_reason
        assert body["usage"] == {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(want.token_ids),
            "total_tokens": len(prompt) + len(want.token_ids),
        }
    listed = client.batches.list(limit=10)
    assert done.id in [b.id for b in listed.data]


def test_a_completions_batch_with_text_prompts(wide, api_url, offline_engine):
    client = client_for(api_url, wide.headers["Authorization"].split()[1])
    prompts = ["Once upon a time", "The cat", "Mud and tea", "Sky:"]
    lines = [
        {
            "custom_id": p,
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": p, "max_tokens": 9, "temperature": 0},
        }
        for p in prompts
    ]
    file = client.files.create(file=("c.jsonl", jsonl(lines)), purpose="batch")
    done = wait_for_batch(
        client,
        client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h").id,
    )
    assert done.status == "completed", done
    output = {
        json.loads(x)["custom_id"]: json.loads(x)
        for x in client.files.content(done.output_file_id).text.splitlines()
    }
    expected = offline_engine.generate(prompts, SamplingParams(max_tokens=9, temperature=0))
    for prompt, want in zip(prompts, expected, strict=True):
        body = output[prompt]["response"]["body"]
        assert body["object"] == "text_completion" and body["choices"][0]["text"] == want.text
        assert body["usage"]["prompt_tokens"] == len(want.prompt_token_ids)


def test_cancel_mid_run_stops_the_running_requests(wide, api_url, new_key):
    key = new_key()
    client = client_for(api_url, key)
    lines = [
        {
            "custom_id": f"long{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "messages": conversation(i),
                "max_tokens": 1500,
                "temperature": 0,
                "stop": ["never-seen-stop"],
            },
        }
        for i in range(12)
    ]
    file = client.files.create(file=("long.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    headers = {"Authorization": f"Bearer {key}"}
    deadline = time.monotonic() + 120
    while not requests.get(
        f"{api_url}/jobs", params={"status": "running"}, headers=headers, timeout=10
    ).json()["jobs"]:
        assert time.monotonic() < deadline, "no job of the batch started"
        time.sleep(0.2)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_for_batch(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at and done.request_counts.total == 12
    assert (
        done.request_counts.completed + done.request_counts.failed == 12 and done.request_counts.failed >= 1
    )
    errors = [json.loads(line) for line in client.files.content(done.error_file_id).text.splitlines()]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"} and len(
        errors
    ) == done.request_counts.failed
    # the running requests left the engine's batch: nothing of this tenant runs or waits any more
    deadline = time.monotonic() + 30
    while wide.engine_stats()["num_running"] or wide.engine_stats().get("num_waiting"):
        assert time.monotonic() < deadline, wide.engine_stats()
        time.sleep(0.2)


def test_a_malformed_file_fails_validation_and_another_tenant_sees_nothing(wide, api_url, new_key):
    alice, bob = client_for(api_url, new_key()), client_for(api_url, new_key())
    lines = [
        {
            "custom_id": "ok",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": conversation(1)},
        },
        {
            "custom_id": "two",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [], "n": 1},
        },
        {
            "custom_id": "n",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": conversation(2), "n": 3},
        },
    ]
    file = alice.files.create(file=("bad.jsonl", jsonl(lines)), purpose="batch")
    batch = alice.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.status == "failed" and batch.request_counts.total == 0
    assert [(e.line, e.param) for e in batch.errors.data] == [(2, "body.messages"), (3, "body.n")]
    with pytest.raises(openai.NotFoundError):
        bob.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        bob.files.retrieve(file.id)
    with pytest.raises(openai.NotFoundError):
        bob.files.content(file.id)
    with pytest.raises(openai.NotFoundError):
        bob.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        alice.batches.create(input_file_id=file.id, endpoint="/v1/embeddings", completion_window="24h")


def test_a_batch_not_done_in_its_window_expires(wide, new_key, sessions, offline_engine):
    """A window of seconds (BATCH_WINDOW_SECONDS; clients still send "24h"): the short requests finish in
    it, the long ones do not. The reconciler's expiry (run here as beat would) cancels the running ones
    (they leave the engine) and the queued ones (they never run), and ends the batch `expired` with the
    finished lines in the output file and the rest in the error file."""
    window = 6.0
    # long ones: twice what the worker holds (8 + 2, or 3 x 8 under preemptive, where every held one runs a
    # quantum), so some stay queued
    short, long = 4, 2 * wide.settings.worker_capacity(8)
    lines = [
        {
            "custom_id": f"{'short' if i < short else 'long'}{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "messages": conversation(i if i < short else 3),  # 3: greedy, no EOS for 1,900 tokens
                "max_tokens": 4 if i < short else 1900,
                "temperature": 0,
                "stop": ["never-seen-stop"],
            },
        }
        for i in range(short + long)
    ]
    with serve_api(wide.settings.replace(batch_window_seconds=window)) as url:
        client = client_for(url, new_key())
        file = client.files.create(file=("mixed.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert batch.expires_at - batch.created_at in (window, window + 1)
        deadline = time.monotonic() + 120
        while (done := client.batches.retrieve(batch.id)).status not in TERMINAL:
            assert time.monotonic() < deadline, done
            expire_batches(sessions, wide.settings)
            time.sleep(0.5)
        assert done.status == "expired" and done.expired_at >= done.expires_at, done
        output = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
        errors = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    counts = done.request_counts
    assert counts.total == short + long and counts.completed + counts.failed == counts.total, counts
    assert short <= counts.completed < counts.total, counts
    assert len(output) == counts.completed and len(errors) == counts.failed
    assert sorted(x["custom_id"] for x in output + errors) == sorted(x["custom_id"] for x in lines)
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    tokenizer = load_tokenizer("tiny-llama")
    by_id = {x["custom_id"]: x for x in lines}
    for line in output:  # what finished is the offline engine's greedy output
        body = by_id[line["custom_id"]]["body"]
        prompt = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, return_dict=True)
        [want] = offline_engine.generate(
            [prompt["input_ids"]],
            SamplingParams(max_tokens=body["max_tokens"], temperature=0, stop=body["stop"]),
        )
        assert line["response"]["body"]["choices"][0]["message"]["content"] == want.text, line["custom_id"]
    # running requests were cut short (they had tokens) and left the engine; queued ones never ran
    deadline = time.monotonic() + 30
    while wide.engine_stats()["num_running"] or wide.engine_stats().get("num_waiting"):
        assert time.monotonic() < deadline, wide.engine_stats()
        time.sleep(0.2)
    with sessions() as s:
        cut = s.execute(
            text(
                "SELECT attempts, cardinality(output_token_ids) AS tokens FROM jobs "
                "WHERE batch_id = :b AND error_code = 'batch_expired'"
            ),
            {"b": batch.id},
        ).all()
    assert len(cut) == counts.failed
    assert any(r.tokens > 0 for r in cut), cut  # some were running at expiry
    assert any(r.attempts == 0 and r.tokens == 0 for r in cut), cut  # some were queued, and never ran
