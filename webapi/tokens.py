"""vLLM's POST /tokenize, /detokenize and GET /tokenizer_info: the named served model's tokenizer (the fleet's
default without `model`), as the engine
encodes prompts (a text gets the tokenizer's special tokens, such as BOS; chat messages are rendered with the
model's template). lm-evaluation-harness's "remote" tokenizer uses these three, so it needs no local copy."""

from __future__ import annotations

from flask import Blueprint

from webapi.auth import require_api_key
from webapi.errors import APIError
from webapi.extensions import services
from webapi.fleet import FleetModel
from webapi.jobs import served_model
from webapi.openai_schemas import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from webapi.prompts import NoChatTemplate, check_token_ids, encode_texts, prepare_prompt, tokenizer_for
from webapi.spec import endpoint

bp = Blueprint("tokens", __name__)
bp.before_request(require_api_key)


@bp.post("/tokenize")
@endpoint(body=TokenizeRequest, responses={200: TokenizeResponse}, errors=(404,))
def tokenize(body: TokenizeRequest):
    """The token ids of a prompt or of chat messages (vLLM's /tokenize), and the model's max_model_len."""
    served = served_model(body.model)
    tokenizer = served_tokenizer(served)
    if body.messages is not None:
        try:
            ids, _, error = prepare_prompt(served.model, messages=[m.for_template() for m in body.messages])
        except NoChatTemplate as exc:
            raise APIError(422, "invalid_request", str(exc)) from None
        if error is not None:
            raise APIError(422, "invalid_request", str(error))
    else:
        add_special = body.add_special_tokens is not False
        [ids] = encode_texts(tokenizer, [body.prompt or ""], add_special_tokens=add_special)
    strings = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return TokenizeResponse(
        count=len(ids), max_model_len=served.max_model_len, tokens=ids, token_strs=strings
    ).model_dump()


@bp.post("/detokenize")
@endpoint(body=DetokenizeRequest, responses={200: DetokenizeResponse}, errors=(404,))
def detokenize(body: DetokenizeRequest):
    """The text of token ids (vLLM's /detokenize), special tokens included."""
    served = served_model(body.model)
    tokenizer = served_tokenizer(served)
    error = check_token_ids(body.tokens, tokenizer, served.name)
    if error is not None:
        raise APIError(422, "invalid_request", f"tokens: {error.message}")
    return DetokenizeResponse(prompt=tokenizer.decode(body.tokens)).model_dump()


@bp.get("/tokenizer_info")
@endpoint(responses={200: TokenizerInfo})
def tokenizer_info():
    """The tokenizer's special tokens and chat template (vLLM's /tokenizer_info)."""
    served = services().fleet.default()
    tokenizer = served_tokenizer(served)
    return TokenizerInfo(
        tokenizer_class=type(tokenizer).__name__,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        pad_token=tokenizer.pad_token,
        unk_token=tokenizer.unk_token,
        chat_template=getattr(tokenizer, "chat_template", None),
        model_max_length=served.max_model_len,
    ).model_dump()


def served_tokenizer(served: FleetModel):
    """The served model's tokenizer; 422 when the model ships none."""
    tokenizer = tokenizer_for(served.model)
    if tokenizer is None:
        raise APIError(422, "invalid_request", f"the model {served.name} has no tokenizer")
    return tokenizer
