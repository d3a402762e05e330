"""A request that fails validation, worded for its caller, the same way on every surface: POST /jobs, /v1
and a batch file's lines. pydantic reports where its validators were (`prompt.constrained-str`,
`prompt.list[constrained-int]`); the caller needs the field as it wrote it, what is wrong with the value,
and the limit:

    prompt: expected a string or an array, got an integer (123)
    max_tokens: expected an integer, got a string ("8")
    messages[0].role: must be 'system', 'developer', 'user' or 'assistant', got "bot"
    stop[1]: must not be empty

A field's path is written as OpenAI writes it (`messages[0].content`), found by following the error's
location through the request itself: a location step that is not a key or an index of the value there
is the name of a union's member, and is dropped. Of a union's members, the one whose type the value has
reports the problem; when the value has none of their types, one message lists them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

JSON_TYPES = {  # an error type meaning "the value is not of this JSON type" -> the type
    "string_type": "a string",
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "a boolean",
    "list_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "dataclass_type": "an object",
    "none_required": "null",
    "bytes_type": "a string",
    "literal_error": None,  # a literal of another type than the value's: named by the literal's message
}
NOT_FOUND = {"model_not_found"}  # error types answered 404, with that code
MISSING = object()


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a request: the field (None: the body as a whole), what is wrong, the code."""

    param: str | None
    text: str
    code: str = "invalid_request"

    def __str__(self) -> str:
        return f"{self.param}: {self.text}" if self.param else self.text

    @property
    def status(self) -> int:
        return 404 if self.code in NOT_FOUND else 422


def problems(exc: ValidationError, document: Any = MISSING) -> list[Problem]:
    """The problems of a request that `exc` refused; `document` is the request as parsed JSON (or a dict of
    query parameters). Without it, every text step of a location is taken as a field name."""
    located = [_locate(e, document) for e in exc.errors(include_url=False)]
    return list(dict.fromkeys(_problem(item) for item in _collapse(located)))  # two members may say the same


def parsed(data: bytes | str) -> Any:
    """The JSON document of a request body that failed validation (to follow its errors' locations)."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError):  # pydantic's parser took it, Python's does not (deep nesting)
        return MISSING


@dataclass
class _Located:
    path: tuple[str | int, ...]  # where in the request: keys and indexes
    unions: list[int]  # for each union member's name passed, the path length where it was
    error: dict
    key: str | None = field(default=None)  # the error is about this key of an object, not its value


def _locate(error: dict, document: Any) -> _Located:
    path: list[str | int] = []
    unions: list[int] = []
    key = None
    node = document
    loc = error["loc"]
    for i, step in enumerate(loc):
        if step == "[key]":  # pydantic's marker: the error is about the key just passed
            key = str(path.pop()) if path else None
            node = MISSING
        elif isinstance(node, dict) and step in node:
            path.append(step)
            node = node[step]
        elif isinstance(node, list) and isinstance(step, int) and 0 <= step < len(node):
            path.append(step)
            node = node[step]
        elif document is MISSING and (isinstance(step, int) or step.isidentifier()):
            path.append(step)  # no document to follow: a name is a field, an index an index
        elif error["type"] == "missing" and i == len(loc) - 1:
            path.append(step)  # the field that is not there
        elif isinstance(step, int):
            path.append(step)
            node = MISSING
        else:
            unions.append(len(path))  # the name of a union's member
    return _Located(tuple(path), unions, error, key)


def _collapse(items: list[_Located]) -> list[_Located | tuple[tuple, list[_Located]]]:
    """Each union's errors as the caller needs them: those of the member whose type the value has, or, when
    it has none of their types, one entry (the union's path, its members' type errors)."""
    out: list[_Located | tuple[tuple, list[_Located]]] = []
    groups: dict[tuple, list[_Located]] = {}
    for item in items:
        if not item.unions:
            out.append(item)
            continue
        union_path = item.path[: item.unions[0]]
        if union_path not in groups:
            groups[union_path] = []
            out.append((union_path, groups[union_path]))  # a place holder, filled below
        groups[union_path].append(item)
    result: list[_Located | tuple[tuple, list[_Located]]] = []
    for entry in out:
        if isinstance(entry, _Located):
            result.append(entry)
            continue
        union_path, members = entry
        mismatched = [m for m in members if m.path == union_path and m.error["type"] in JSON_TYPES]
        matched = [m for m in members if m not in mismatched]
        if not matched:
            result.append((union_path, mismatched))
            continue
        for m in matched:
            m.unions = m.unions[1:]
        result.extend(_collapse(matched))
    return result


def _problem(item: _Located | tuple[tuple, list[_Located]]) -> Problem:
    if isinstance(item, tuple):
        path, members = item
        value = members[0].error["input"]
        kinds = _join(list(dict.fromkeys(_expected(m.error) for m in members)), "or")
        return Problem(param_name(path), f"expected {kinds}, got {describe(value)}")
    error = item.error
    text = _text(error)
    if item.key is not None:
        text = f"the key {_show(item.key)} {text}"
    code = error["type"] if error["type"] in NOT_FOUND else "invalid_request"
    return Problem(param_name(item.path), text, code)


def param_name(path: Sequence[str | int]) -> str | None:
    """A field's path as OpenAI writes it: `messages[0].content`."""
    name = ""
    for step in path:
        name += f"[{step}]" if isinstance(step, int) else (f".{step}" if name else str(step))
    return name or None


def _expected(error: dict) -> str:
    if error["type"] == "literal_error":
        return error["ctx"]["expected"]
    return JSON_TYPES[error["type"]] or "another type"


def _text(error: dict) -> str:
    kind, ctx, value = error["type"], error.get("ctx", {}), error.get("input")
    if kind in JSON_TYPES and kind != "literal_error":
        return f"expected {JSON_TYPES[kind]}, got {describe(value)}"
    if kind == "missing":
        return "required, and missing"
    if kind == "extra_forbidden":
        return "not a field genq takes here (genq refuses what it cannot honour rather than ignore it)"
    if kind == "literal_error":
        return f"must be {ctx['expected']}, got {_show(value)}"
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        bound = {"greater_than_equal": "at least", "greater_than": "more than"}.get(kind) or (
            "at most" if kind == "less_than_equal" else "less than"
        )
        limit = ctx.get("ge", ctx.get("gt", ctx.get("le", ctx.get("lt"))))
        return f"must be {bound} {limit}, got {_show(value)}"
    if kind == "finite_number":
        return f"must be a finite number, got {_show(value)}"
    if kind == "string_too_short":
        if ctx["min_length"] == 1:
            return "must not be empty"
        return f"must be at least {ctx['min_length']} characters, got {len(value)}"
    if kind == "string_too_long":
        return f"must be at most {ctx['max_length']:,} characters, got {len(value):,}"
    if kind in ("too_short", "too_long"):
        bound = "at least" if kind == "too_short" else "at most"
        limit = ctx["min_length" if kind == "too_short" else "max_length"]
        got = ctx.get("actual_length")
        items = "item" if limit == 1 else "items"
        return f"must hold {bound} {limit} {items}" + (f", got {got}" if got is not None else "")
    if kind in ("value_error", "assertion_error"):
        return str(ctx.get("error", error["msg"])).removeprefix("Value error, ")
    if kind in NOT_FOUND or not kind.endswith("_parsing"):
        return error["msg"][:1].lower() + error["msg"][1:]
    return f"{error['msg'][:1].lower() + error['msg'][1:]}, got {_show(value)}"  # a query parameter's text


def describe(value: Any) -> str:
    """A value's JSON type, with the value when it is short: `a string ("8")`."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({json.dumps(value)})"
    if isinstance(value, int):
        return f"an integer ({value})"
    if isinstance(value, float):
        return f"a number ({_show(value)})"
    if isinstance(value, str):
        return f"a string ({_show(value)})"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _show(value: Any) -> str:
    if isinstance(value, str):
        return json.dumps(value if len(value) <= 40 else value[:40] + "…", ensure_ascii=False)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return f"{value:.1f}"
    try:
        return json.dumps(value)[:60]
    except (TypeError, ValueError):
        return type(value).__name__


def _join(words: list[str], last: str) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + f" {last} " + words[-1]
