"""The lines of a batch's output and error files, in OpenAI's shape: a succeeded request's line holds the
response body its endpoint answers (`chat.completion` or `text_completion`, with `choices` and `usage`);
a failed or cancelled one holds the error instead (`batch_expired` for the requests an expired batch cut
short: jobstore/batches.py records that code on their jobs)."""

from __future__ import annotations

from jobstore.models import JobStatus

CHAT_ENDPOINT = "/v1/chat/completions"


def output_line(job, endpoint: str, model: str, batch_cancelled: bool = False) -> dict:
    """The line for one job of a batch (a row with the columns jobstore.batches._batch_jobs reads)."""
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
        return line
    line["response"] = {
        "status_code": 200,
        "request_id": str(job.id),
        "body": response_body(job, endpoint, model),
    }
    return line


def response_body(job, endpoint: str, model: str) -> dict:
    """What the endpoint would have answered for this job."""
    usage = {
        "prompt_tokens": job.prompt_tokens or 0,
        "completion_tokens": job.completion_tokens,
        "total_tokens": (job.prompt_tokens or 0) + job.completion_tokens,
    }
    created = int(job.finished_at.timestamp()) if job.finished_at else 0
    if endpoint == CHAT_ENDPOINT:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": job.output_text},
            "logprobs": None,
            "finish_reason": job.finish_reason,
        }
        kind, prefix = "chat.completion", "chatcmpl-"
    else:
        choice = {"index": 0, "text": job.output_text, "logprobs": None, "finish_reason": job.finish_reason}
        kind, prefix = "text_completion", "cmpl-"
    return {
        "id": prefix + job.id.hex,
        "object": kind,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage,
    }
