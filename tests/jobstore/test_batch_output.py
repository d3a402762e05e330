"""A succeeded job's reply body (jobstore/batch_output.py): the same for a batch output line and a synchronous
answer; with log probabilities and echo in OpenAI's and vLLM's shapes (contract/logprob_shapes.py)."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from types import SimpleNamespace

from batching.tokenizer import load_tokenizer
from jobstore.batch_output import output_line, response_body
from jobstore.models import JobStatus

TOKENIZER = load_tokenizer("tiny-llama")
PROMPT_IDS = TOKENIZER.encode("Hi")  # BOS, "H", "i"
BANG, QUOTE, HASH, DOLLAR = TOKENIZER.encode('!"#$', add_special_tokens=False)
STORED = {
    "prompt": [
        [PROMPT_IDS[0], None, []],
        [PROMPT_IDS[1], -2.5, [[70, -1.0]]],
        [PROMPT_IDS[2], -0.5, [[PROMPT_IDS[2], -0.5]]],
    ],
    "tokens": [[BANG, -0.25, [[BANG, -0.25], [QUOTE, -2.0]]], [HASH, -1.5, [[DOLLAR, -0.75], [HASH, -1.5]]]],
}


def row(**columns) -> SimpleNamespace:
    values = dict(
        id=uuid.uuid4(),
        status=JobStatus.SUCCEEDED,
        metadata_={"custom_id": "a"},
        prompt=None,
        input_ids=PROMPT_IDS,
        options={},
        logprobs=None,
        output_text="!#",
        completion_tokens=2,
        prompt_tokens=3,
        finish_reason="length",
        finished_at=datetime.now(timezone.utc),
    )
    return SimpleNamespace(**(values | columns))


def test_completion_logprobs_and_echo():
    job = row(options={"logprobs": 2, "echo": True, "prompt_logprobs": 2}, logprobs=STORED)
    [choice] = response_body(job, "/v1/completions", "tiny-llama", TOKENIZER)["choices"]
    assert choice["text"] == TOKENIZER.decode(PROMPT_IDS) + "!#"
    lp = choice["logprobs"]
    assert lp["token_logprobs"] == [None, -2.5, -0.5, -0.25, -1.5]
    assert lp["tokens"] == [TOKENIZER.decode([t]) for t in PROMPT_IDS + [BANG, HASH]]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][3] == {"!": -0.25, '"': -2.0}
    assert lp["top_logprobs"][4] == {"#": -1.5, "$": -0.75}  # the token itself joins its top ones
    assert lp["text_offset"] == [0, 3, 4, 5, 6]
    assert "prompt_logprobs" not in choice  # echo shows them in logprobs
    plain = response_body(
        row(options={"logprobs": 0}, logprobs={"tokens": STORED["tokens"], "prompt": None}),
        "/v1/completions",
        "m",
        TOKENIZER,
    )
    assert plain["choices"][0]["text"] == "!#" and plain["choices"][0]["logprobs"]["text_offset"] == [0, 1]


def test_echo_with_max_tokens_0_is_the_prompt_alone():
    """echo_only (/v1/completions' echo with max_tokens 0): the one token the job drew is left out of the
    text, the log probabilities and the usage; the choice ends at its length (the reply's and a batch line's)."""
    job = row(
        options={"logprobs": 1, "echo": True, "prompt_logprobs": 1, "echo_only": True},
        logprobs={"prompt": STORED["prompt"], "tokens": STORED["tokens"][:1]},
        output_text="!",
        completion_tokens=1,
        finish_reason="stop",
    )
    body = response_body(job, "/v1/completions", "tiny-llama", TOKENIZER)
    [choice] = body["choices"]
    assert choice["text"] == TOKENIZER.decode(PROMPT_IDS) and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == [None, -2.5, -0.5]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 0, "total_tokens": 3}


def test_vllm_prompt_logprobs_and_chat_logprobs():
    job = row(options={"prompt_logprobs": 1}, logprobs={"prompt": STORED["prompt"], "tokens": None})
    [choice] = response_body(job, "/v1/completions", "m", TOKENIZER)["choices"]
    assert choice["logprobs"] is None
    first, second, third = choice["prompt_logprobs"]
    assert first is None and second[str(PROMPT_IDS[1])] == {
        "logprob": -2.5,
        "rank": None,
        "decoded_token": "H",
    }
    assert second["70"]["rank"] == 1 and third[str(PROMPT_IDS[2])]["rank"] == 1
    chat = response_body(
        row(options={"logprobs": 2}, logprobs=STORED), "/v1/chat/completions", "m", TOKENIZER
    )
    [token, _] = chat["choices"][0]["logprobs"]["content"]
    assert token == {
        "token": "!",
        "logprob": -0.25,
        "bytes": [33],
        "top_logprobs": [
            {"token": "!", "logprob": -0.25, "bytes": [33]},
            {"token": '"', "logprob": -2.0, "bytes": [34]},
        ],
    }


def test_a_batch_line_holds_the_same_body():
    job = row(options={"logprobs": 2}, logprobs=STORED)
    line = output_line(job, "/v1/completions", "m", tokenizer=TOKENIZER)
    assert line["response"]["body"] == response_body(job, "/v1/completions", "m", TOKENIZER)
