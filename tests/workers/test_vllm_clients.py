"""Clients written for vLLM's server, against the real stack (gunicorn API, a real worker): the request
body of vLLM's benchmark client (`vllm bench serve --backend openai --endpoint /v1/completions`,
vllm/benchmarks/lib/endpoint_request_func.py: async_request_openai_completions) runs untouched, and vLLM's
sampling fields that genq honours (ignore_eos, stop_token_ids, top_k) mean what they mean there."""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest
import requests

from batching import SamplingParams
from tests.conftest import serve_api

PROMPT = "Once upon a time"
ENDING_CANDIDATES = [
    "Q: What is 2+2?\nA:",
    "Hello",
    "The capital of France is",
    "User: Hi\nAssistant:",
    "1, 2, 3,",
]


def greedy(offline_engine, prompt, max_tokens: int, **params):
    [out] = offline_engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, **params))
    return out


def vllm_bench_payload(prompt: str, output_len: int, ignore_eos: bool) -> dict:
    """The body vLLM's benchmark sends, field for field (its default sampling is greedy, via extra_body)."""
    payload = {
        "model": "tiny-llama",
        "prompt": prompt,
        "repetition_penalty": 1.0,
        "max_tokens": output_len,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        payload["ignore_eos"] = ignore_eos
    payload.update({"temperature": 0.0})
    return payload


def read_stream(response: requests.Response) -> tuple[str, dict | None]:
    """What vLLM's benchmark client reads from the events: the text of the choices, and the usage chunk.

    Read as that client reads (vllm/benchmarks/lib/endpoint_request_func.py, StreamedResponseHandler):
    each network read is stripped of its surrounding whitespace and added to a buffer; messages are split
    off at blank lines, and what remains is taken whole only when it is `data: ` and valid JSON. Comment
    messages are skipped, but a comment sent on its own loses its blank line to the strip and glues onto
    what comes next, so a stream that sent one is never read (the client counts it as failed)."""
    text, usage, buffer, done = "", None, "", False
    messages: list[str] = []
    for read in response.iter_content(chunk_size=None):
        if not (read := read.strip()):
            continue
        buffer += read.decode()
        while "\n\n" in buffer:
            message, buffer = buffer.split("\n\n", 1)
            messages.append(message.strip())
        if buffer.startswith("data: "):
            rest = buffer.removeprefix("data: ").strip()
            try:
                if rest != "[DONE]":
                    json.loads(rest)
                messages.append(buffer.strip())
                buffer = ""
            except ValueError:
                pass
    for message in messages:
        if not message or message.startswith(":"):
            continue
        chunk = message.removeprefix("data: ")
        if chunk == "[DONE]":
            done = True
            break
        data = json.loads(chunk)
        if choices := data.get("choices"):
            text += choices[0].get("text") or ""
        elif data.get("usage"):
            usage = data["usage"]
    assert done and not buffer, f"the client could not read the stream; left unread: {buffer[:200]!r}"
    return text, usage


def test_vllms_benchmark_request_runs_untouched(wide, api_url, offline_engine):
    # a prompt the (random) model ends by itself within 200 tokens, so that ignore_eos matters
    ends = (greedy(offline_engine, p, 200) for p in ENDING_CANDIDATES)
    with_eos = next((out for out in ends if out.finish_reason == "stop"), None)
    assert with_eos is not None, "none of the prompts ends with EOS: pick others"
    prompt = offline_engine.tokenizer.decode(with_eos.prompt_token_ids, skip_special_tokens=True)
    past_eos = greedy(offline_engine, prompt, 200, ignore_eos=True)
    headers = {"Authorization": wide.headers["Authorization"], "x-request-id": "bench-0"}
    for ignore_eos, want in ((True, past_eos), (False, with_eos)):
        with requests.post(
            f"{api_url}/v1/completions",
            json=vllm_bench_payload(prompt, 200, ignore_eos),
            headers=headers,
            stream=True,
            timeout=120,
        ) as r:
            assert r.status_code == 200, r.text
            text, usage = read_stream(r)
        assert text == want.text and usage is not None
        assert usage["completion_tokens"] == len(want.token_ids)
        assert usage["prompt_tokens"] == len(want.prompt_token_ids)
    assert len(past_eos.token_ids) == 200


def test_a_stream_that_waits_for_its_first_token_is_read_whole_by_vllms_client(narrow, offline_engine):
    """The stream waits in the queue behind a running job for 2 s, longer than KEEPALIVE_SECONDS, so the
    server writes heartbeats before its first token: vLLM's benchmark client still reads every event (a comment
    line there made it count half the requests of a loaded `vllm bench serve` as failed)."""
    want = greedy(offline_engine, PROMPT, 8)
    with serve_api(narrow.settings) as url:  # started first: the blocker's 1,500 tokens last a few seconds
        # priority 0, as a /v1 call's: of equal priority, the stream's job waits for it (no hand-back)
        blocker = narrow.submit(
            prompt="A long story", max_tokens=1500, temperature=0, ignore_eos=True, priority=0
        )
        narrow.wait(blocker, until=lambda j: j["status"] == "running")
        cancel = threading.Timer(
            2.0, lambda: narrow.client.post(f"/jobs/{blocker}/cancel", headers=narrow.headers)
        )
        started = time.monotonic()
        cancel.start()  # the blocker goes in 2 s; until then, the stream gets only heartbeats
        with requests.post(
            f"{url}/v1/completions",
            json=vllm_bench_payload(PROMPT, 8, ignore_eos=False),
            headers={"Authorization": narrow.headers["Authorization"]},
            stream=True,
            timeout=120,
        ) as r:
            assert r.status_code == 200, r.text
            text, usage = read_stream(r)
        waited = time.monotonic() - started
    cancel.join()
    assert waited > 1.5, f"the stream did not wait ({waited:.2f} s): no heartbeat was tested"
    assert text == want.text and usage is not None and usage["completion_tokens"] == len(want.token_ids)


def test_vllms_sampling_fields_mean_what_they_mean_there(openai_client, offline_engine):
    plain = greedy(offline_engine, PROMPT, 30, ignore_eos=True)
    stop_id = plain.token_ids[5]
    want = greedy(offline_engine, PROMPT, 30, stop_token_ids=[stop_id])
    reply = openai_client.completions.create(
        model="tiny-llama",
        prompt=PROMPT,
        max_tokens=30,
        temperature=0,
        extra_body={"stop_token_ids": [stop_id], "top_k": -1, "min_tokens": 0, "skip_special_tokens": True},
    )
    assert reply.choices[0].text == want.text and reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == len(want.token_ids) <= 6
    seeded = dict(model="tiny-llama", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=7)
    with_k = openai_client.completions.create(**seeded, extra_body={"top_k": 3})
    want = offline_engine.generate([PROMPT], SamplingParams(max_tokens=12, temperature=1.0, seed=7, top_k=3))
    assert with_k.choices[0].text == want[0].text
    penalties = dict(repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.3, min_p=0.05)
    penalized = openai_client.completions.create(**seeded, extra_body=penalties)
    want = offline_engine.generate(
        [PROMPT], SamplingParams(max_tokens=12, temperature=1.0, seed=7, **penalties)
    )
    assert penalized.choices[0].text == want[0].text


def test_what_genq_cannot_honour_is_refused_with_the_reason(openai_client):
    for field, value in (("allowed_token_ids", [1, 2]), ("use_beam_search", True), ("best_of", 2)):
        with pytest.raises(openai.BadRequestError) as bad:
            openai_client.completions.create(model="tiny-llama", prompt="x", extra_body={field: value})
        assert bad.value.body["param"] == field and "leave it out" in bad.value.message


def test_logit_bias_through_every_path(wide, openai_client, offline_engine):
    """OpenAI's logit_bias: a banned token never comes, greedy or not; the same tokens as the offline engine
    with the same bias, synchronous, streamed (chat) and through POST /jobs."""
    plain = greedy(offline_engine, PROMPT, 12, ignore_eos=True)
    banned = plain.token_ids[2]
    bias = {banned: -100.0, plain.token_ids[5]: -3.0, 65: 4.0}
    want = greedy(offline_engine, PROMPT, 12, ignore_eos=True, logit_bias=bias)
    assert want.token_ids != plain.token_ids and banned not in want.token_ids
    as_json = {str(t): b for t, b in bias.items()}
    reply = openai_client.completions.create(
        model="tiny-llama",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        logit_bias=as_json,
        extra_body={"ignore_eos": True},
    )
    assert reply.choices[0].text == want.text
    job = wide.wait(
        wide.submit(prompt=PROMPT, max_tokens=12, temperature=0, ignore_eos=True, logit_bias=as_json)
    )
    assert job["output"]["token_ids"] == want.token_ids
    chat = [{"role": "user", "content": "Hi"}]
    ids = offline_engine.tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True)[
        "input_ids"
    ]
    [sampled] = offline_engine.generate(
        [ids], SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True, logit_bias=bias)
    )
    streamed = openai_client.chat.completions.create(
        model="tiny-llama",
        messages=chat,
        max_tokens=10,
        temperature=1.0,
        seed=3,
        logit_bias=as_json,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == sampled.text
    assert banned not in sampled.token_ids
    with pytest.raises(openai.BadRequestError) as bad:
        openai_client.completions.create(model="tiny-llama", prompt="x", logit_bias={"12": 150})
    assert bad.value.body["param"] == "logit_bias.12" and "at most 100" in bad.value.message


def test_min_tokens_holds_back_the_stop_token(wide, openai_client, offline_engine):
    """vLLM's min_tokens: a stop token id greedy draws early cannot end the choice before min_tokens."""
    plain = greedy(offline_engine, PROMPT, 20, ignore_eos=True)
    stop = plain.token_ids[1]
    want = greedy(offline_engine, PROMPT, 20, ignore_eos=True, stop_token_ids=[stop], min_tokens=6)
    assert len(want.token_ids) >= 6
    reply = openai_client.completions.create(
        model="tiny-llama",
        prompt=PROMPT,
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop], "min_tokens": 6},
    )
    assert reply.choices[0].text == want.text and reply.usage.completion_tokens == len(want.token_ids)
    job = wide.wait(
        wide.submit(
            prompt=PROMPT, max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[stop], min_tokens=6
        )
    )
    assert job["output"]["token_ids"] == want.token_ids
    with pytest.raises(openai.BadRequestError) as bad:
        openai_client.completions.create(
            model="tiny-llama", prompt="x", max_tokens=3, extra_body={"min_tokens": 4}
        )
    assert bad.value.body["param"] == "min_tokens" and "at most max_tokens (3)" in bad.value.message


def test_include_stop_str_in_output_and_skip_special_tokens(openai_client, offline_engine):
    """vLLM's include_stop_str_in_output (the stop string stays at the end) and skip_special_tokens false
    (special tokens in the text), synchronous and streamed: the offline engine's text."""
    plain = greedy(offline_engine, PROMPT, 30, ignore_eos=True)
    stop = next(c for c in plain.text[4:] if 32 < ord(c) < 127)
    want = greedy(offline_engine, PROMPT, 30, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert want.text.endswith(stop) and want.finish_reason == "stop"
    body = dict(model="tiny-llama", prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop])
    extra = {"ignore_eos": True, "include_stop_str_in_output": True}
    reply = openai_client.completions.create(**body, extra_body=extra)
    assert reply.choices[0].text == want.text
    streamed = openai_client.completions.create(**body, extra_body=extra, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want.text
    specials = dict(model="tiny-llama", prompt=PROMPT, max_tokens=3, temperature=0, logit_bias={"1": 100})
    reply = openai_client.completions.create(**specials, extra_body={"skip_special_tokens": False})
    assert reply.choices[0].text == "<s><s><s>"
    streamed = openai_client.completions.create(
        **specials, extra_body={"skip_special_tokens": False}, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == "<s><s><s>"
    assert openai_client.completions.create(**specials).choices[0].text == ""


def test_n_choices_of_one_prompt(wide, openai_client, offline_engine):
    """n: one job per choice, choice j seeded seed + j, in order (the chat's prompt rendered once)."""
    ids = offline_engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_dict=True
    )["input_ids"]
    want = offline_engine.generate(
        [ids] * 3, [SamplingParams(max_tokens=6, temperature=1.0, seed=5 + j) for j in range(3)]
    )
    before = wide.engine_stats()["num_prompt_tokens_computed"]
    reply = openai_client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6,
        temperature=1.0,
        seed=5,
        n=3,
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == [w.text for w in want]
    assert reply.usage.prompt_tokens == 3 * len(ids)
    # the prompt is computed once: the later choices start on its blocks (one token each, or at most a block)
    block = offline_engine.config.block_size
    assert wide.engine_stats()["num_prompt_tokens_computed"] - before <= len(ids) + 2 * block
    streamed = list(
        openai_client.chat.completions.create(
            model="tiny-llama",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=6,
            temperature=1.0,
            seed=5,
            n=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts, finishes = ["", "", ""], [None, None, None]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                assert finishes[choice.index] is None  # one finish per choice
                finishes[choice.index] = choice.finish_reason
    assert texts == [w.text for w in want] and finishes == [w.finish_reason for w in want]
    roles = [c.choices[0].index for c in streamed if c.choices and c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1, 2]
    assert streamed[-1].usage.completion_tokens == sum(len(w.token_ids) for w in want)
