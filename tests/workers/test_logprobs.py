"""Log probabilities through the whole stack with the official `openai` client (the API under gunicorn, a
real worker): completions `logprobs` / `echo` / vLLM's `prompt_logprobs`, chat `logprobs` + `top_logprobs`,
streamed or not, and the job's `logprobs` in GET /jobs/<id>; the same numbers as the offline engine, and
lm-evaluation-harness's loglikelihood request equal to transformers' log-likelihoods."""

from __future__ import annotations

import importlib.util
import math
import uuid

import openai
import pytest
import requests
import torch

from batching import SamplingParams
from batching.models import build_tiny_llama, tiny_llama_config
from batching.tokenizer import load_tokenizer

PROMPT = "Once upon a time"
CHAT = [{"role": "user", "content": "What comes after Tuesday?"}]
TOL = 1e-4  # the worker's float32 engine against float64 references


@pytest.fixture(scope="module")
def hf_logprobs():
    """hf_logprobs(ids) -> [T, V]: transformers' float64 log-softmax for tiny-llama's weights."""
    model = build_tiny_llama(tiny_llama_config()).to(torch.float64).eval()

    def run(ids):
        with torch.inference_mode():
            return model(torch.tensor([list(ids)])).logits[0].log_softmax(-1)

    return run


def test_completion_logprobs_are_the_engines_streamed_or_not(wide, openai_client, offline_engine):
    tokenizer = load_tokenizer("tiny-llama")
    [want] = offline_engine.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, logprobs=3))
    reply = openai_client.completions.create(
        model="tiny-llama", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3
    )
    lp = reply.choices[0].logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in want.token_ids]
    assert max(abs(a - b.logprob) for a, b in zip(lp.token_logprobs, want.logprobs, strict=True)) < TOL
    for top, w in zip(lp.top_logprobs, want.logprobs, strict=True):
        assert set(top) >= {tokenizer.decode([t]) for t, _ in w.top} and len(top) <= 4
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    streamed = list(
        openai_client.completions.create(
            model="tiny-llama", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3, stream=True
        )
    )
    pieces = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [t for p in pieces for t in p.tokens] == lp.tokens
    streamed_logprobs = [x for p in pieces for x in p.token_logprobs]  # another run: float32 rounds anew
    assert max(abs(a - b) for a, b in zip(streamed_logprobs, lp.token_logprobs, strict=True)) < TOL
    assert [x for p in pieces for x in p.text_offset] == lp.text_offset
    job = wide.job(str(uuid.UUID(reply.id.removeprefix("cmpl-"))))
    assert [entry[1] for entry in job["logprobs"]["tokens"]] == lp.token_logprobs
    assert job["logprobs"]["prompt"] is None


def test_chat_logprobs_with_top_logprobs(openai_client, offline_engine):
    ids = load_tokenizer("tiny-llama").apply_chat_template(
        CHAT, add_generation_prompt=True, return_dict=True
    )["input_ids"]
    [want] = offline_engine.generate([ids], SamplingParams(max_tokens=6, temperature=0, logprobs=2))
    reply = openai_client.chat.completions.create(
        model="tiny-llama", messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == len(want.token_ids)
    for got, w in zip(content, want.logprobs, strict=True):
        assert abs(got.logprob - w.logprob) < TOL and len(got.top_logprobs) == 2
        assert bytes(got.bytes).decode("utf-8", "replace") == got.token
        assert [abs(t.logprob - lp) < TOL for t, (_, lp) in zip(got.top_logprobs, w.top, strict=True)] == [
            True
        ] * 2
    with pytest.raises(openai.BadRequestError) as bad:
        openai_client.chat.completions.create(model="tiny-llama", messages=CHAT, top_logprobs=2)
    assert "logprobs=true" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        openai_client.completions.create(model="tiny-llama", prompt="x", logprobs=21)
    assert bad.value.body["param"] == "logprobs" and "at most 20" in bad.value.message


def loglikelihood_request(api_url, key: str, context: list[int], continuation: list[int]) -> dict:
    """lm-evaluation-harness's `local-completions` loglikelihood request (lm_eval/models/openai_completions.py
    _create_payload with generate=False): the prompt as token ids, echo, logprobs 1, max_tokens 1, temperature 0."""
    payload = {
        "model": "tiny-llama",
        "prompt": context + continuation,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    r = requests.post(
        f"{api_url}/v1/completions", json=payload, headers={"Authorization": f"Bearer {key}"}, timeout=120
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_lm_eval_loglikelihood_request_gives_transformers_loglikelihoods(wide, api_url, hf_logprobs):
    """What the harness computes from the reply (lm_eval's parse_logprobs: the continuation's token_logprobs
    summed, and whether each was the top token) against the same from transformers' float64 logits."""
    tokenizer = load_tokenizer("tiny-llama")
    key = wide.headers["Authorization"].split()[1]
    context = tokenizer.encode("Question: which day comes after Tuesday? Answer:")
    for choice in (" Wednesday", " Monday", " blue"):
        continuation = tokenizer.encode(choice, add_special_tokens=False)
        reply = loglikelihood_request(api_url, key, context, continuation)
        lp = reply["choices"][0]["logprobs"]
        n = len(context) + len(continuation)
        assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == n + 1  # the prompt, 1 token
        got = sum(lp["token_logprobs"][len(context) : n])
        greedy = all(
            max(top.values()) == lp["token_logprobs"][i]
            for i, top in enumerate(lp["top_logprobs"][len(context) : n], len(context))
        )
        ref = hf_logprobs(context + continuation)
        want = sum(ref[q - 1, t].item() for q, t in enumerate(continuation, len(context)))
        want_greedy = all(ref[q - 1].argmax().item() == t for q, t in enumerate(continuation, len(context)))
        assert abs(got - want) < 1e-3 and greedy == want_greedy, (choice, got, want)
        assert reply["choices"][0]["text"].startswith(tokenizer.decode(context + continuation)[:10])


def test_echo_with_max_tokens_0_is_the_prompt_alone(openai_client, hf_logprobs):
    """OpenAI's max_tokens 0 with echo (scoring a text): the prompt and its log probabilities, no generated
    token (the job draws one, as vLLM's does, and the answer leaves it out), streamed or not."""
    tokenizer = load_tokenizer("tiny-llama")
    ids = tokenizer.encode(PROMPT)
    reply = openai_client.completions.create(
        model="tiny-llama", prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    choice = reply.choices[0]
    assert choice.text == tokenizer.decode(ids) and choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 0 and reply.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in ids] and lp.token_logprobs[0] is None
    ref = hf_logprobs(ids)
    assert max(abs(lp.token_logprobs[q] - ref[q - 1, ids[q]].item()) for q in range(1, len(ids))) < TOL
    chunks = list(
        openai_client.completions.create(
            model="tiny-llama",
            prompt=PROMPT,
            max_tokens=0,
            echo=True,
            logprobs=1,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == PROMPT and texts[0] == PROMPT
    [prompt_chunk] = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert prompt_chunk.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:], abs=TOL)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError) as bad:
        openai_client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=0)
    assert bad.value.body["param"] == "max_tokens" and "at least 1" in bad.value.message


def test_a_streamed_echo_sends_the_prompt_first(openai_client, offline_engine):
    """echo, streamed: the first chunk carries the prompt (as vLLM's), then the generated text; with logprobs,
    the prompt's log probabilities in that first chunk."""
    [want] = offline_engine.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0))
    chunks = list(
        openai_client.completions.create(
            model="tiny-llama", prompt=PROMPT, max_tokens=6, temperature=0, echo=True, stream=True
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts[0] == PROMPT and "".join(texts) == PROMPT + want.text
    # with logprobs: the first chunk brings the prompt's too (its first token's null), as the reply does
    reply = openai_client.completions.create(
        model="tiny-llama", prompt=PROMPT, max_tokens=6, temperature=0, echo=True, logprobs=1
    )
    chunks = list(
        openai_client.completions.create(
            model="tiny-llama", prompt=PROMPT, max_tokens=6, temperature=0, echo=True, logprobs=1, stream=True
        )
    )
    pieces = [c.choices[0] for c in chunks if c.choices]
    assert pieces[0].text == PROMPT and pieces[0].logprobs.token_logprobs[0] is None
    streamed = [x for p in pieces if p.logprobs for x in p.logprobs.token_logprobs]
    want = reply.choices[0].logprobs.token_logprobs
    assert len(streamed) == len(want) and streamed[0] is None
    assert max(abs(a - b) for a, b in zip(streamed[1:], want[1:], strict=True)) < TOL
    assert [x for p in pieces if p.logprobs for x in p.logprobs.text_offset] == reply.choices[
        0
    ].logprobs.text_offset


def test_vllms_prompt_logprobs(openai_client, hf_logprobs):
    ids = load_tokenizer("tiny-llama").encode(PROMPT)
    reply = openai_client.completions.create(
        model="tiny-llama", prompt=ids, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    prompt_logprobs = reply.choices[0].model_extra["prompt_logprobs"]
    ref = hf_logprobs(ids)
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(ids)
    for q, entry in enumerate(prompt_logprobs[1:], 1):
        mine = entry[str(ids[q])]
        assert math.isclose(mine["logprob"], ref[q - 1, ids[q]].item(), abs_tol=TOL)
        top = sorted((v for v in entry.values() if v["rank"]), key=lambda v: v["rank"])
        assert [t["rank"] for t in top][:2] == [1, 2]


@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm-evaluation-harness not installed")
def test_lm_eval_local_completions_runs_against_genq(wide, api_url, hf_logprobs, offline_engine, monkeypatch):
    """The harness itself (`--model local-completions`), with genq's remote tokenizer: loglikelihood gives
    transformers' log-likelihoods (<= 1e-3) and the same greedy choice; generate_until the engine's text."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    key = wide.headers["Authorization"].split()[1]
    monkeypatch.setenv("OPENAI_API_KEY", key)
    lm = LocalCompletionsAPI(
        base_url=f"{api_url}/v1/completions", model="tiny-llama", auth_token=key, batch_size=2, max_gen_toks=8
    )
    assert lm.tokenizer_backend == "remote"  # it found /tokenizer_info and /tokenize
    tokenizer = load_tokenizer("tiny-llama")
    context = "Question: which day comes after Tuesday? Answer:"
    choices = [" Wednesday", " Monday", " blue"]
    results = lm.loglikelihood(
        [Instance("loglikelihood", {}, (context, c), i) for i, c in enumerate(choices)]
    )
    for (got, got_greedy), choice in zip(results, choices, strict=True):
        whole = tokenizer.encode(context + choice, add_special_tokens=False)
        n = len(tokenizer.encode(context, add_special_tokens=False))
        ref = hf_logprobs(whole)
        want = sum(ref[q - 1, whole[q]].item() for q in range(n, len(whole)))
        want_greedy = all(ref[q - 1].argmax().item() == whole[q] for q in range(n, len(whole)))
        assert abs(got - want) <= 1e-3 and got_greedy == want_greedy, (choice, got, want)
    until = {"until": ["\n\n"], "max_gen_toks": 8, "do_sample": False}
    [text] = lm.generate_until([Instance("generate_until", {}, (context, until), 0)])
    ids = tokenizer.encode(context, add_special_tokens=False)
    [want] = offline_engine.generate([ids], SamplingParams(max_tokens=8, temperature=0, stop=["\n\n"]))
    assert text == want.text


def test_a_list_of_prompts_answers_one_choice_each(openai_client, offline_engine):
    tokenizer = load_tokenizer("tiny-llama")
    for prompts in ([PROMPT, "Hello", "The end"], [tokenizer.encode("The end"), tokenizer.encode("Hi")]):
        want = offline_engine.generate(prompts, SamplingParams(max_tokens=5, temperature=0, logprobs=0))
        reply = openai_client.completions.create(
            model="tiny-llama", prompt=prompts, max_tokens=5, temperature=0, logprobs=0
        )
        assert [c.index for c in reply.choices] == list(range(len(prompts)))
        assert [c.text for c in reply.choices] == [w.text for w in want]
        assert reply.usage.completion_tokens == sum(len(w.token_ids) for w in want)
        assert reply.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    prompts = [PROMPT, "Hello"]
    want = offline_engine.generate(prompts, SamplingParams(max_tokens=5, temperature=0, logprobs=0))
    texts, pieces = ["", ""], [[], []]
    for chunk in openai_client.completions.create(
        model="tiny-llama", prompt=prompts, max_tokens=5, temperature=0, logprobs=0, echo=False, stream=True
    ):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            pieces[choice.index] += choice.logprobs.token_logprobs if choice.logprobs else []
    assert texts == [w.text for w in want]
    for got, w in zip(pieces, want, strict=True):  # each choice's own, in order
        assert max(abs(a - b.logprob) for a, b in zip(got, w.logprobs, strict=True)) < TOL
