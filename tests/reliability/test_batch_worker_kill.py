"""A worker killed with kill -9 in the middle of a batch: with the reconciler running (as beat would) and a
new worker, the batch still completes, every line once, each with the output an uninterrupted run gives.
Driven by the official `openai` client against the API under gunicorn."""

from __future__ import annotations

import json
import time

import openai
from sqlalchemy import text

from batching import Engine, EngineConfig, SamplingParams
from batching.tokenizer import load_tokenizer
from tests.conftest import serve_api
from tests.reliability.conftest import Reconciler, stack_settings, wait_for

LINES = 10
MAX_TOKENS = 300  # long enough that jobs are mid-generation at the kill


def conversation(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Tell story number {i} about {'tea' if i % 2 else 'mud'}."}]


def batch_progress(sessions, batch_id: str) -> list:
    with sessions() as s:
        return s.execute(
            text(
                "SELECT status, attempts, cardinality(output_token_ids) AS tokens FROM jobs "
                "WHERE batch_id = :b ORDER BY batch_index"
            ),
            {"b": batch_id},
        ).all()


def test_a_worker_killed_mid_batch_still_completes_every_line_once(settings, sessions, new_key, make_worker):
    st = stack_settings(
        settings, lease_seconds=2.0, progress_interval=0.2, max_num_seqs=4, reconcile_interval=0.5
    )
    lines = [
        {
            "custom_id": f"story-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "messages": conversation(i),
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "stop": ["zzzz"],
            },
        }
        for i in range(LINES)
    ]
    first = make_worker(st, concurrency=8)
    first.start()
    with serve_api(st) as url, Reconciler(sessions, st, interval=0.5) as reconciler:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=new_key(), max_retries=0, timeout=60)
        file = client.files.create(
            file=("stories.jsonl", b"".join(json.dumps(x).encode() + b"\n" for x in lines)), purpose="batch"
        )
        batch = client.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        wait_for(
            lambda: sum(r.tokens > 0 for r in batch_progress(sessions, batch.id)) >= 3,
            120,
            "3 requests of the batch generating",
        )
        first.kill9()
        at_kill = batch_progress(sessions, batch.id)
        assert any(r.status == "running" and r.tokens > 0 for r in at_kill), at_kill  # killed mid-generation
        make_worker(st, concurrency=8).start()
        deadline = time.monotonic() + 300
        while (done := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
            assert time.monotonic() < deadline, (
                f"batch still {done.status}: {batch_progress(sessions, batch.id)}"
            )
            time.sleep(0.3)
        assert reconciler.totals["requeued"] >= 1  # the dead worker's jobs went back to the queue
        assert done.status == "completed" and done.request_counts.completed == LINES, done
        output = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]

    assert sorted(line["custom_id"] for line in output) == sorted(x["custom_id"] for x in lines)  # each once
    assert any(r.attempts >= 2 for r in batch_progress(sessions, batch.id))  # some were resumed elsewhere

    tokenizer = load_tokenizer("tiny-llama")
    prompts = [
        tokenizer.apply_chat_template(conversation(i), add_generation_prompt=True, return_dict=True)[
            "input_ids"
        ]
        for i in range(LINES)
    ]
    engine = Engine(EngineConfig(**st.engine_options()))
    expected = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop=["zzzz"]))
    by_id = {line["custom_id"]: line["response"]["body"] for line in output}
    for i, want in enumerate(expected):
        body = by_id[f"story-{i}"]
        assert body["choices"][0]["message"]["content"] == want.text, i
        assert body["usage"]["completion_tokens"] == len(want.token_ids)
