"""Text made outside the engine (SamplingParams(detokenize=False) + detokenizer.OutputText, as the worker makes
it): row for row the same text as the engine's own, through broken UTF-8 (tiny-llama's tokens are bytes),
special tokens kept, stop tokens with and without their text, min_tokens, resumed tokens, preemption and
aborts (one before its first row)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from batching import Engine, EngineConfig, SamplingParams
from batching.detokenizer import Detokenizer, OutputText

N = 12
STOP_IDS = list(range(100, 150))  # bytes with text: a stop token's text shows whether it was decoded


def params_of(i: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=24 + 3 * i,
        temperature=0.0 if i % 5 == 4 else 1.0,
        seed=i,
        skip_special_tokens=i % 2 == 0,
        stop_token_ids=STOP_IDS if i % 2 == 0 else [],
        include_stop_str_in_output=i % 4 == 0,
        min_tokens=4 if i % 6 == 1 else 0,
        ignore_eos=i == 5,
        output_kind="delta",
    )


def resumed_of(i: int) -> list[int] | None:
    """Some requests resume from saved tokens: UTF-8 lead bytes among them (a character split by the resume)."""
    if i % 4 != 1:
        return None
    rng = random.Random(i)
    if i == 9:  # aborted before its first step: whole characters, which the engine never decodes
        return [3 + rng.randrange(0x61, 0x7B) for _ in range(5)]
    return [rng.randrange(3, 259) for _ in range(5)] + [3 + 0xE2, 3 + 0x82]


def rows_of(detokenize: bool) -> dict[str, list[tuple]]:
    """Each request's rows (token start, tokens, text start, text, finish reason) over a run that preempts
    (a pool too small for all) and aborts r7 mid-run and r9 before its first step."""
    engine = Engine(
        EngineConfig(
            model="tiny-llama",
            dtype="float32",
            device="cpu",
            block_size=4,
            num_device_blocks=20,
            max_num_seqs=6,
            max_num_batched_tokens=32,
            preemption_mode="recompute",
        )
    )
    rng = random.Random(7)
    rows: dict[str, list[tuple]] = {f"r{i}": [] for i in range(N)}
    for i in range(N):
        params = dataclasses.replace(params_of(i), detokenize=detokenize)
        prompt = [rng.randrange(3, 259) for _ in range(3 + i)]
        engine.add_request(f"r{i}", prompt, params, priority=i % 3, resume_token_ids=resumed_of(i))
    assert engine.abort("r9")
    step = 0
    while engine.has_unfinished_requests():
        if step == 6:
            assert engine.abort("r7")
        deltas = engine.step_deltas()
        for row, request_id in enumerate(deltas.request_ids):
            rows[request_id].append(
                (
                    deltas.token_starts[row],
                    deltas.token_ids[row],
                    deltas.text_starts[row],
                    deltas.texts[row],
                    deltas.finish_reasons[row],
                )
            )
        step += 1
    assert engine.stats()["num_preemptions"] > 0
    return rows


def replay(rows: dict[str, list[tuple]], detokenizer: Detokenizer) -> dict[str, list[tuple]]:
    """The rows of a detokenize=False run with their text made as the worker makes it: step by step, one
    Detokenizer pass per step over the requests the step reported (row k of each request is step k's here:
    the order of calls within a step changes nothing but the tables)."""
    texts = {request_id: OutputText(params_of(int(request_id[1:]))) for request_id in rows}
    made: dict[str, list[tuple]] = {request_id: [] for request_id in rows}
    for k in range(max(map(len, rows.values()))):
        step = [(request_id, own[k]) for request_id, own in rows.items() if k < len(own)]
        to_decode = [texts[r] for r, row in step if texts[r].take(row[1], row[4])]
        for r, _ in step:
            made[r].append(len(texts[r].text))
        detokenizer(to_decode)
        for r, (token_start, tokens, _, _, reason) in step:
            start = made[r].pop()
            made[r].append((token_start, tokens, start, texts[r].text[start:], reason))
    return made


@pytest.fixture(scope="module")
def runs():
    return rows_of(True), rows_of(False)


def test_the_engine_makes_no_text_without_detokenize(runs):
    with_text, without = runs
    assert all(row[3] == "" and row[2] == 0 for own in without.values() for row in own)
    # the same tokens, rows and finish reasons: only the text differs
    strip = {r: [(a, b, e) for a, b, _, _, e in own] for r, own in with_text.items()}
    assert strip == {r: [(a, b, e) for a, b, _, _, e in own] for r, own in without.items()}


@pytest.mark.parametrize("backend", ["rust", "tokenizer.decode"])
def test_text_made_from_the_rows_equals_the_engines_row_for_row(runs, tiny_engine, backend):
    with_text, without = runs
    detokenizer = Detokenizer(tiny_engine.tokenizer)
    if backend != "rust":
        detokenizer.backend = None  # the path of tokenizers with a decode of their own
    made = replay(without, detokenizer)
    assert made == with_text
    # what the workload covers: broken UTF-8, stops by token with and without its text, aborts, resumes
    texts = {r: "".join(row[3] for row in own) for r, own in with_text.items()}
    reasons = {r: own[-1][4] for r, own in with_text.items()}
    assert any("\ufffd" in t for t in texts.values())
    assert reasons["r9"] == reasons["r7"] == "abort" and with_text["r9"][0][1] and not with_text["r9"][0][3]
    assert all(reasons[f"r{i}"] == "stop" for i in (0, 4, 8)), "stop tokens kept in the text"
    assert all(reasons[f"r{i}"] == "stop" for i in (2, 6, 10)), "stop tokens left out"


def test_stop_strings_need_the_text():
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)
    with pytest.raises(ValueError, match="detokenize must be a boolean"):
        SamplingParams(detokenize=1)
