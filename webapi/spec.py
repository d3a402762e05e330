"""Request validation and the OpenAPI document, both from the schemas in webapi/schemas.py.

`@endpoint(body=..., query=..., responses=...)` validates the request into the view's `body` / `query`
arguments and records the same models on the view; `openapi(app)` walks the URL map and turns those
records into the document served at /openapi.json. Nothing about an endpoint is written twice.

Why a layer of our own (about 200 lines) rather than flask-openapi3, SpecTree or APIFlask: each of them
brings its own route decorators and its own validation-error body, while genq answers in two shapes (its
own `{"error": {code, message}}` on /jobs, OpenAI's on /v1, which the `openai` client parses), documents
Retry-After on every 429/503, and streams batch uploads instead of parsing a whole multipart body into a
model. Adopting one would touch every view and still need this much glue; the document itself is checked
against the running API by schemathesis (tests/reliability/test_api_hostile.py). Revisit if this file grows.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

from flask import Flask, request
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema

from contract.fields import SERVED_MODELS, VOCAB_SIZE
from webapi.errors import OPENAI_PREFIX, APIError, from_validation_error
from webapi.extensions import services
from webapi.fleet import ModelNotServed
from webapi.openai_schemas import OpenAIError
from webapi.prompts import vocab_size
from webapi.schemas import ErrorResponse
from webapi.validation import parsed

REF = "#/components/schemas/{model}"
PATH_ARG = re.compile(r"<(?:([^:<>]+):)?([^<>]+)>")  # werkzeug's <converter:name>
ERROR_STATUSES = {
    400: "Malformed JSON",
    401: "Missing or unknown API key",
    403: "A priority more urgent than the tenant's top_priority (priority_not_allowed)",
    404: "Not found (or another tenant's); a `model` this server does not serve (model_not_found)",
    409: "Conflict",
    413: "Body too large (over MAX_BODY_BYTES)",
    415: "Body is not JSON",
    422: "Invalid field or limit",
    429: "Too many requests for this key (the tenant's rate_limit, else RATE_LIMIT), too many queued jobs (for "
    "this tenant or in all), or the tenant's token_budget spent; retry after Retry-After seconds",
    503: "Postgres or Redis unavailable; retry after Retry-After seconds",
}
RETRY_AFTER = {
    "Retry-After": {"description": "Seconds to wait before retrying", "schema": {"type": "integer"}}
}


@dataclass
class Operation:
    summary: str
    responses: dict[int, type[BaseModel] | None]  # None: raw bytes (a file's content)
    body: type[BaseModel] | None = None
    query: type[BaseModel] | None = None
    form: type[BaseModel] | None = None  # a multipart/form-data body (the view reads it)
    errors: list[int] = field(default_factory=list)
    auth: bool = True
    headers: dict[str, str] = field(default_factory=dict)


def endpoint(
    *,
    responses: dict[int, type[BaseModel] | None],
    body: type[BaseModel] | None = None,
    query: type[BaseModel] | None = None,
    form: type[BaseModel] | None = None,
    errors: tuple[int, ...] = (),
    auth: bool = True,
    headers: dict[str, str] | None = None,
):
    """Validate the JSON body / query string into `body=` / `query=` and document the view (a multipart
    `form=` is documented only: the view reads it, as it streams its file)."""

    def decorate(view):
        @functools.wraps(view)
        def validated(*args, **kwargs):
            if body is not None:
                kwargs["body"] = parse_body(body)
            if query is not None:
                kwargs["query"] = parse_query(query)
            return view(*args, **kwargs)

        validated.operation = Operation(
            summary=(view.__doc__ or "").strip().splitlines()[0],
            responses=responses,
            body=body,
            query=query,
            form=form,
            errors=sorted(
                {
                    *errors,
                    # a call with a key: the key is checked in Postgres, and counted against its rate limit
                    *([401, 429, 503] if auth else []),
                    *([400, 413, 415, 422] if body else []),
                    *([400, 413, 422] if form else []),
                    *([422] if query else []),
                }
            ),
            auth=auth,
            headers=headers or {},
        )
        return validated

    return decorate


def parse_body(model: type[BaseModel]) -> BaseModel:
    """The request body as `model`: 415 if not JSON, 413 if too large, 400 if malformed, 422 if invalid."""
    if not request.is_json:
        raise APIError(
            415, "unsupported_media_type", "send the body as JSON with Content-Type: application/json"
        )
    data = request.get_data(cache=False)
    try:
        return model.model_validate_json(data, context=validation_context())
    except ValidationError as exc:
        raise from_validation_error(exc, document=parsed(data)) from None


def validation_context() -> dict:
    """What request bodies are checked against beyond their schema: the models the fleet serves, and the
    vocabulary of the model a body names (logit_bias's token ids), looked up only for a body that needs it."""
    return {SERVED_MODELS: services().fleet.names(), VOCAB_SIZE: model_vocabulary}


def model_vocabulary(name: str | None) -> tuple[str, int | None] | None:
    """(the served name, its tokenizer's vocabulary size) of the model `name` names (None: the fleet's default);
    None for a name the fleet does not serve (its body is refused for that)."""
    try:
        served = services().fleet.resolve(name)
    except ModelNotServed:
        return None
    return served.name, vocab_size(served.model)


def parse_query(model: type[BaseModel]) -> BaseModel:
    """The query string as `model` (repeated parameters are refused); 422 names the parameter."""
    args = request.args.to_dict(flat=False)
    repeated = [name for name, values in args.items() if len(values) > 1]
    if repeated:
        raise APIError(422, "invalid_request", f"{repeated[0]}: give this parameter once")
    document = {name: values[0] for name, values in args.items()}
    try:
        return model.model_validate(document)
    except ValidationError as exc:
        raise from_validation_error(exc, where="query", document=document) from None


def openapi(app: Flask, title: str, version: str) -> dict:
    """The OpenAPI 3.1 document of every @endpoint view registered on `app`."""
    paths: dict[str, dict] = {}
    models = {
        ErrorResponse: "serialization",
        OpenAIError: "serialization",
    }  # requests validate, responses serialize
    for rule in sorted(app.url_map.iter_rules(), key=lambda r: r.rule):
        op: Operation | None = getattr(app.view_functions[rule.endpoint], "operation", None)
        if op is None:
            continue
        models.update({m: "serialization" for m in op.responses.values() if m is not None})
        models.update({m: "validation" for m in (op.body, op.query, op.form) if m is not None})
        for method in sorted(rule.methods - {"HEAD", "OPTIONS"}):
            paths.setdefault(_path(rule.rule), {})[method.lower()] = _operation(rule, op)
    _, schemas = models_json_schema(
        sorted(models.items(), key=lambda item: item[0].__name__), ref_template=REF
    )
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {
            "schemas": schemas.get("$defs", {}),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer", "description": "An API key."}},
        },
    }


def _path(rule: str) -> str:
    return PATH_ARG.sub(r"{\2}", rule)


def _operation(rule, op: Operation) -> dict:
    doc: dict = {"summary": op.summary, "operationId": rule.endpoint.replace(".", "_"), "responses": {}}
    params = [
        {
            "name": name,
            "in": "path",
            "required": True,
            "schema": {"type": "string", "format": "uuid"} if converter == "uuid" else {"type": "string"},
        }
        for converter, name in PATH_ARG.findall(rule.rule)
    ]
    if op.query is not None:
        for name, prop in op.query.model_json_schema()["properties"].items():
            params.append(
                {
                    "name": name,
                    "in": "query",
                    "required": False,
                    "schema": prop,
                    "description": prop.get("description", ""),
                }
            )
    params += [
        {"name": name, "in": "header", "required": False, "schema": {"type": "string"}, "description": text}
        for name, text in op.headers.items()
    ]
    if params:
        doc["parameters"] = params
    if op.body is not None:
        doc["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": REF.format(model=op.body.__name__)}}},
        }
    if op.form is not None:
        doc["requestBody"] = {
            "required": True,
            "content": {"multipart/form-data": {"schema": {"$ref": REF.format(model=op.form.__name__)}}},
        }
    for status, model in op.responses.items():
        if model is None:
            doc["responses"][str(status)] = {
                "description": "The file's content",
                "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
            }
            continue
        doc["responses"][str(status)] = {
            "description": (model.__doc__ or model.__name__).strip().splitlines()[0],
            "content": {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}},
        }
    error_model = "OpenAIError" if rule.rule.startswith(OPENAI_PREFIX) else "ErrorResponse"
    for status in (*op.errors, *([404] if rule.arguments else [])):
        doc["responses"][str(status)] = {
            "description": ERROR_STATUSES[status],
            "content": {"application/json": {"schema": {"$ref": REF.format(model=error_model)}}},
            **({"headers": RETRY_AFTER} if status in (429, 503) else {}),
        }
    if op.auth:
        doc["security"] = [{"bearer": []}]
    return doc
