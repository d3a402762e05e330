"""Stops and limits: EOS (and ignore_eos), stop_token_ids, stop strings (matched on decoded text, cut before
the stop, never mid-character), max_tokens and max_model_len, each with the right finish_reason.

The model is random, so the tokens to stop on are picked from a first greedy run of the same prompt.
The built-in tokenizer is byte-level: a multi-byte UTF-8 character spans several tokens.
"""

from __future__ import annotations

import pytest

from batching import Engine, EngineConfig, SamplingParams
from batching.tokenizer import EOS_ID
from tests.batching.conftest import random_prompts, run_to_completion

MAX = 48


@pytest.fixture(scope="module")
def engine():
    return Engine(
        EngineConfig(
            model="tiny-llama",
            dtype="float64",
            device="cpu",
            max_num_batched_tokens=64,
            block_size=8,
            num_device_blocks=300,
            num_host_blocks=0,
        )
    )


@pytest.fixture(scope="module")
def runs(engine):
    """(prompt, greedy tokens ignoring EOS) for 30 prompts."""
    prompts = random_prompts(80, [5 + i % 7 for i in range(30)])
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX, temperature=0, ignore_eos=True))
    return [(p, o.token_ids) for p, o in zip(prompts, outs, strict=True)]


def solo(engine, prompt, **params):
    """Run one greedy request; returns (final output, texts of every streamed output)."""
    params.setdefault("max_tokens", MAX)
    engine.add_request("solo", prompt, SamplingParams(temperature=0, **params))
    texts, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts.append(out.text)
            final = out
        engine.check_invariants()
    assert final.finished
    return final, texts


def decode(engine, tokens) -> str:
    return engine.tokenizer.decode(tokens, skip_special_tokens=True)


def tokens_until(engine, tokens, stop: str) -> int:
    """The fewest tokens whose decoded text contains `stop`."""
    return next(m for m in range(1, len(tokens) + 1) if stop in decode(engine, tokens[:m]))


def assert_streamed_text_grows(texts):
    for before, after in zip(texts[:-1], texts[1:], strict=True):
        assert after.startswith(before), "streamed text changed what it had already reported"
    assert all(not t.endswith("\ufffd") for t in texts), "text ended mid-character"


def test_eos_stops_unless_ignored(engine, runs):
    prompt, tokens = next((p, t) for p, t in runs if EOS_ID in t[: MAX - 5])
    k = tokens.index(EOS_ID)
    out, _ = solo(engine, prompt)
    assert out.token_ids == tokens[: k + 1] and out.finish_reason == "stop"
    assert out.text == decode(engine, tokens[:k])  # EOS is special: not in the text
    out, _ = solo(engine, prompt, ignore_eos=True, max_tokens=k + 5)
    assert out.token_ids == tokens[: k + 5] and out.finish_reason == "length"
    # an explicit stop token id wins over ignore_eos
    out, _ = solo(engine, prompt, ignore_eos=True, stop_token_ids=[EOS_ID])
    assert out.token_ids == tokens[: k + 1] and out.finish_reason == "stop"


def test_stop_token_ids(engine, runs):
    prompt, tokens = next((p, t) for p, t in runs if EOS_ID not in t)
    stop_at = tokens.index(tokens[6])  # its first occurrence, at most 6
    later = next(t for t in tokens[stop_at + 1 :] if t not in tokens[: stop_at + 1])
    out, _ = solo(engine, prompt, stop_token_ids=[later, tokens[6]])
    assert out.token_ids == tokens[: stop_at + 1] and out.finish_reason == "stop"
    out, _ = solo(engine, prompt, stop_token_ids=[tokens[0]])
    assert out.token_ids == tokens[:1] and out.finish_reason == "stop"  # stops on the prefill's token


def ascii_substring(text: str, start: int, length: int) -> str:
    """The first run of `length` printable ASCII characters at or after `start`."""
    for i in range(start, len(text) - length):
        piece = text[i : i + length]
        if all(32 < ord(c) < 127 for c in piece):
            return piece
    raise AssertionError("no printable ASCII run in the greedy text")


def test_stop_string_cuts_text_before_it(engine, runs):
    prompt, tokens = next((p, t) for p, t in runs if EOS_ID not in t)
    full = decode(engine, tokens)
    stop = ascii_substring(full, 8, 2)
    at = full.index(stop)
    out, texts = solo(engine, prompt, stop=[stop])
    assert out.finish_reason == "stop"
    assert out.text == full[:at] and stop not in out.text
    assert out.token_ids == tokens[: tokens_until(engine, tokens, stop)]
    assert_streamed_text_grows(texts[:-1])


def test_earliest_of_several_stop_strings_wins(engine, runs):
    prompt, tokens = next((p, t) for p, t in runs if EOS_ID not in t)
    full = decode(engine, tokens)
    early = ascii_substring(full, 4, 1)
    late = ascii_substring(full, full.index(early) + 6, 3)
    assert late not in full[: full.index(late)] and early not in late
    out, _ = solo(engine, prompt, stop=[late, early])
    assert out.text == full[: full.index(early)]
    assert out.token_ids == tokens[: tokens_until(engine, tokens, early)]


def multibyte_char(engine, runs):
    """A run whose greedy text holds a character of 3+ UTF-8 bytes (else 2), and that character."""
    best = None
    for prompt, tokens in runs:
        if EOS_ID in tokens:
            continue
        for ch in decode(engine, tokens):
            size = len(ch.encode())
            if ch != "\ufffd" and size >= 2 and (best is None or size > len(best[2].encode())):
                best = (prompt, tokens, ch)
    assert best is not None, "no multi-byte character in the greedy texts"
    return best


def test_multibyte_stop_string_is_matched_on_whole_characters(engine, runs):
    prompt, tokens, ch = multibyte_char(engine, runs)
    full = decode(engine, tokens)
    out, texts = solo(engine, prompt, stop=[ch])
    m = tokens_until(engine, tokens, ch)
    # it stops at the token that completes the character, not at its first byte
    assert out.token_ids == tokens[:m] and out.finish_reason == "stop"
    assert out.text == full[: full.index(ch)]
    assert_streamed_text_grows(texts[:-1])


def test_stop_string_sharing_leading_bytes_does_not_stop(engine, runs):
    """A stop string whose UTF-8 bytes differ from a generated character only in the last byte does not
    match that character: stops are compared as text, never as partial bytes."""
    prompt, tokens, ch = multibyte_char(engine, runs)
    raw = ch.encode()
    near = next(
        c
        for b in range(0x80, 0xC0)
        if b != raw[-1]
        for c in [(raw[:-1] + bytes([b])).decode(errors="replace")]
        if "\ufffd" not in c
    )
    full = decode(engine, tokens)
    assert near != ch and near not in full
    out, texts = solo(engine, prompt, stop=[near])
    assert out.token_ids == tokens and out.finish_reason == "length"
    assert ch in out.text
    assert_streamed_text_grows(texts)


def test_max_tokens_gives_length(engine, runs):
    prompt, tokens = runs[0]
    out, _ = solo(engine, prompt, max_tokens=5, ignore_eos=True)
    assert out.token_ids == tokens[:5] and out.finish_reason == "length"
    out, _ = solo(engine, prompt, max_tokens=1, ignore_eos=True)
    assert out.token_ids == tokens[:1] and out.finish_reason == "length"


def test_timing_fields(engine, runs):
    prompt, _ = runs[1]
    engine.add_request("t", prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    first = engine.step()[0]
    assert first.first_token_time is not None and first.finish_time is None and not first.finished
    assert first.arrival_time <= first.first_token_time
    last = run_to_completion(engine)["t"]
    assert last.first_token_time == first.first_token_time
    assert last.arrival_time <= last.first_token_time <= last.finish_time


def test_max_model_len_ends_with_length():
    engine = Engine(
        EngineConfig(
            model="tiny-llama",
            dtype="float32",
            device="cpu",
            max_model_len=24,
            block_size=4,
            num_device_blocks=12,
        )
    )
    prompt = random_prompts(81, [16])[0]
    engine.add_request("fits", prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    out = run_to_completion(engine)["fits"]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"
    with pytest.raises(ValueError, match=r"max_model_len \(24\)"):
        engine.add_request("too-long", prompt, SamplingParams(max_tokens=9))
    assert not engine.has_unfinished_requests()


def test_stop_strings_completed_by_the_same_token_cut_at_the_earliest(engine, runs):
    """Stops "xy" and "y" both complete when "y" arrives: the text is cut before "xy", whatever their order."""
    prompt, tokens = next((p, t) for p, t in runs if EOS_ID not in t)
    full = decode(engine, tokens)
    pair = ascii_substring(full, 5, 2)
    at = full.index(pair)
    assert pair[1] not in full[: at + 1]
    for stops in ([pair[1], pair], [pair, pair[1]]):
        out, _ = solo(engine, prompt, stop=stops)
        assert out.text == full[:at], stops


def repeats(engine, tokens) -> list[tuple[str, int, int]]:
    """(c, m, at) for each printable character c that the text of the first m tokens holds (m the fewest),
    and the text after them holds again, first at `at`."""
    full = decode(engine, tokens)
    return [
        (c, m, at)
        for c in dict.fromkeys(full)
        if 32 < ord(c) < 127
        and (m := tokens_until(engine, tokens, c)) < len(tokens) - 1
        and (at := full.find(c, len(decode(engine, tokens[:m])))) != -1
    ]


def test_min_tokens_holds_back_eos_stop_ids_and_stop_strings(engine, runs):
    """vLLM's min_tokens: the end of sequence and stop_token_ids cannot be drawn before min_tokens tokens, and
    a stop string ends the request only from the token after them on (vLLM's detokenizer checks stop strings
    once len(output) > min_tokens, on the text from then on)."""
    prompt, tokens = next((p, t) for p, t in runs if EOS_ID in t[:10])
    k = tokens.index(EOS_ID)
    out, _ = solo(engine, prompt, min_tokens=k + 3, max_tokens=k + 8)
    assert len(out.token_ids) >= k + 3 and EOS_ID not in out.token_ids[: k + 3]
    assert out.token_ids[:k] == tokens[:k] and out.token_ids[k] != EOS_ID
    prompt, tokens = next((p, t) for p, t in runs if EOS_ID not in t)
    out, _ = solo(engine, prompt, stop_token_ids=[tokens[0]], min_tokens=5)
    assert out.token_ids[:1] != tokens[:1] and tokens[0] not in out.token_ids[:5]
    prompt, tokens, (stop, m, after) = next((p, t, r[0]) for p, t in runs if (r := repeats(engine, t)))
    full = decode(engine, tokens)
    out, _ = solo(engine, prompt, stop=[stop])
    assert out.text == full[: full.index(stop)] and len(out.token_ids) == m  # without min_tokens
    out, _ = solo(engine, prompt, stop=[stop], min_tokens=m)
    assert out.finish_reason == "stop" and out.text == full[:after] and len(out.token_ids) > m, (stop, m)
    with pytest.raises(ValueError, match=r"min_tokens must be an integer from 0 to max_tokens \(4\)"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_include_stop_str_in_output_keeps_the_stop(engine, runs):
    """vLLM's include_stop_str_in_output: the stop string that ended the request stays at the end of the
    text, and so does a stop token's text (without it, a token that ends the request adds no text)."""
    prompt, tokens = next((p, t) for p, t in runs if EOS_ID not in t)
    full = decode(engine, tokens)
    stop = ascii_substring(full, 8, 2)
    at = full.index(stop)
    out, texts = solo(engine, prompt, stop=[stop], include_stop_str_in_output=True)
    assert out.finish_reason == "stop" and out.text == full[: at + len(stop)]
    assert out.token_ids == tokens[: tokens_until(engine, tokens, stop)]
    assert_streamed_text_grows(texts)
    stop_id = next(t for t in tokens[4:] if 32 < ord(decode(engine, [t])[:1] or "\0") < 127)  # an ASCII byte
    k = tokens.index(stop_id)
    out, _ = solo(engine, prompt, stop_token_ids=[stop_id])
    assert out.token_ids == tokens[: k + 1] and out.text == decode(engine, tokens[:k]).rstrip("\ufffd")
    out, _ = solo(engine, prompt, stop_token_ids=[stop_id], include_stop_str_in_output=True)
    assert out.token_ids == tokens[: k + 1] and out.text == decode(engine, tokens[: k + 1])


def test_skip_special_tokens_false_keeps_them_in_the_text(engine, runs):
    """vLLM's skip_special_tokens: false decodes special tokens into the text (streamed text too); the end
    of sequence that ends the request stays out unless include_stop_str_in_output."""
    prompt = runs[0][0]
    out, texts = solo(engine, prompt, max_tokens=3, logit_bias={1: 100.0}, skip_special_tokens=False)
    assert out.token_ids == [1, 1, 1] and out.text == "<s><s><s>" and texts[:2] == ["<s>", "<s><s>"]
    out, _ = solo(engine, prompt, max_tokens=3, logit_bias={1: 100.0})
    assert out.text == ""
    prompt, tokens = next((p, t) for p, t in runs if EOS_ID in t[: MAX - 5])
    k = tokens.index(EOS_ID)
    with_specials = engine.tokenizer.decode(tokens[:k], skip_special_tokens=False)
    out, _ = solo(engine, prompt, skip_special_tokens=False)
    assert out.token_ids == tokens[: k + 1] and out.text == with_specials
    out, _ = solo(engine, prompt, skip_special_tokens=False, include_stop_str_in_output=True)
    assert out.text == with_specials + "</s>"
