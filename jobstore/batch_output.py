"""The lines of a batch's output and error files, in OpenAI's shape: a succeeded request's line holds the
response body its endpoint answers (`chat.completion` or `text_completion`, with `choices` and `usage`);
a failed or cancelled one holds the error instead (`batch_expired` for the requests an expired batch cut
short: jobstore/batches.py records that code on their jobs). A line refused as its endpoint would refuse the
request alone (a model the fleet does not serve) also holds that answer as its `response`: the status and
OpenAI's error body, as OpenAI's error file holds a request answered with an error."""

from __future__ import annotations

from contract.logprob_shapes import chat_logprobs, completion_logprobs, vllm_prompt_logprobs
from jobstore.models import JobStatus

CHAT_ENDPOINT = "/v1/chat/completions"
# error codes of lines refused as their request alone would be: the HTTP status and the field it names
REFUSALS = {"model_not_found": (404, "model")}


def output_line(job, endpoint: str, model: str, batch_cancelled: bool = False, tokenizer=None) -> dict:
    """The line for one job of a batch (a row with the columns jobstore.batches._batch_jobs reads);
    `tokenizer` names the tokens of log probabilities and echoes token-id prompts."""
    custom_id = (job.metadata_ or {}).get("custom_id")
    line = {"id": f"batch_req_{job.id.hex}", "custom_id": custom_id, "response": None, "error": None}
    if job.status != JobStatus.SUCCEEDED:
        if job.status != JobStatus.CANCELLED or job.error_code:  # failed, or cancelled for a reason (expiry)
            error = {"code": job.error_code or "failed", "message": job.error_message or "the request failed"}
        elif batch_cancelled:
            error = {
                "code": "batch_cancelled",
                "message": "the batch was cancelled before this request finished",
            }
        else:
            error = {"code": "cancelled", "message": f"this request's job ({job.id}) was cancelled"}
        line["error"] = error
        if job.error_code in REFUSALS:
            status, param = REFUSALS[job.error_code]
            body = {
                "message": error["message"],
                "type": "invalid_request_error",
                "param": param,
                "code": error["code"],
            }
            line["response"] = {"status_code": status, "request_id": str(job.id), "body": {"error": body}}
        return line
    line["response"] = {
        "status_code": 200,
        "request_id": str(job.id),
        "body": response_body(job, endpoint, model, tokenizer),
    }
    return line


def response_body(job, endpoint: str, model: str, tokenizer=None) -> dict:
    """What the endpoint would have answered for this job (a row with id, prompt, input_ids, options,
    output_text, logprobs, prompt_tokens, completion_tokens, finish_reason, finished_at)."""
    options, stored = job.options or {}, job.logprobs or {}
    completion_tokens = 0 if options.get("echo_only") else job.completion_tokens  # the prompt alone
    usage = {
        "prompt_tokens": job.prompt_tokens or 0,
        "completion_tokens": completion_tokens,
        "total_tokens": (job.prompt_tokens or 0) + completion_tokens,
    }
    created = int(job.finished_at.timestamp()) if job.finished_at else 0
    if endpoint == CHAT_ENDPOINT:
        logprobs = chat_logprobs(stored["tokens"], tokenizer) if stored.get("tokens") is not None else None
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": job.output_text},
            "logprobs": logprobs,
            "finish_reason": job.finish_reason,
        }
        kind, prefix = "chat.completion", "chatcmpl-"
    else:
        choice = completion_choice(job, options, stored, tokenizer)
        kind, prefix = "text_completion", "cmpl-"
    return {
        "id": prefix + job.id.hex,
        "object": kind,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


def completion_choice(job, options: dict, stored: dict, tokenizer) -> dict:
    """A text_completion's choice: the text (after the prompt's, with `echo`), its log probabilities, and
    vLLM's prompt_logprobs when asked."""
    echo, alone = options.get("echo", False), options.get("echo_only", False)  # alone: max_tokens 0
    prompt_text = echoed_prompt(job, tokenizer) if echo else ""
    logprobs = None
    if stored.get("tokens") is not None:
        entries = [] if alone else list(stored["tokens"])  # the token drawn for max_tokens 0 is left out
        if echo:
            entries = list(stored.get("prompt") or ()) + entries
        logprobs = completion_logprobs(entries, tokenizer)
    choice = {
        "index": 0,
        "text": prompt_text + ("" if alone else job.output_text),
        "logprobs": logprobs,
        "finish_reason": "length" if alone else job.finish_reason,
    }
    if stored.get("prompt") is not None and options.get("prompt_logprobs") is not None and not echo:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(stored["prompt"], tokenizer)
    return choice


def echoed_prompt(job, tokenizer) -> str:
    """The prompt's text as `echo` gives it: the text sent, or the token ids sent, decoded."""
    return job.prompt if job.prompt is not None else tokenizer.decode(list(job.input_ids))
