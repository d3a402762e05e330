"""contract.deltas: a transcript built from a row and deltas in any overlap holds every token and character
once, in order; a delta that starts beyond it is refused (Gap), never appended with a hole."""

from __future__ import annotations

import random

import pytest

from contract.deltas import Delta, Gap, Position, Transcript, trim

TEXT = "Once upon a time, \u00e9t\u00e9 \U0001f600 the end."


def pieces(seed: int) -> list[Delta]:
    """TEXT cut into deltas at random places, with one token per character (and some empty texts)."""
    rng = random.Random(seed)
    out, at = [], 0
    while at < len(TEXT):
        n = rng.randint(0, 4)
        out.append(Delta(at, [ord(c) for c in TEXT[at : at + n]], at, TEXT[at : at + n]))
        at += n
    return out[:-1] + [out[-1]._replace(finish_reason="length")]


@pytest.mark.parametrize("seed", range(20))
def test_any_prefix_then_overlapping_deltas_rebuild_the_output_once(seed):
    rng = random.Random(seed)
    deltas = pieces(seed)
    known = rng.randint(0, len(TEXT))  # what a row holds
    t = Transcript([ord(c) for c in TEXT[:known]], TEXT[:known])
    sent = [TEXT[:known]]
    replayed = deltas[: rng.randint(0, len(deltas))] + deltas  # events seen twice (a row and events overlap)
    for d in replayed:
        if d.start > t.position.tokens:
            with pytest.raises(Gap):
                t.add(d)
            continue
        new = t.add(d)
        if new is not None:
            assert new.start == len("".join(sent))
            sent.append(new.text)
    assert "".join(sent) == TEXT == t.text
    assert t.token_ids == [ord(c) for c in TEXT] and t.finish_reason == "length"
    assert t.since(Position(3, 3)).text == TEXT[3:] and t.text_since(5, 9) == TEXT[5:9]


def test_a_gap_is_refused_and_trim_takes_only_what_is_missing():
    d = Delta(4, [1, 2, 3], 10, "abc")
    with pytest.raises(Gap):
        trim(d, Position(3, 10))
    with pytest.raises(Gap):
        trim(d, Position(4, 9))
    assert trim(d, Position(5, 11)) == Delta(5, [2, 3], 11, "bc")
    assert trim(d, Position(7, 13)) is None
    assert trim(d._replace(finish_reason="stop"), Position(7, 13)).finish_reason == "stop"
    assert trim(d._replace(finish_reason="stop"), Position(7, 13), finished=True) is None
    fields = trim(d._replace(fields={"logprobs": [-1.0, -2.0, -3.0]}), Position(6, 12))
    assert fields.token_ids == [3] and fields.fields == {"logprobs": [-3.0]}


def test_positions_round_trip_as_event_ids():
    assert Position.parse(Position(12, 40).id) == Position(12, 40)
    assert Position.parse("12") is None and Position.parse("a.b") is None and Position.parse("-1.2") is None


def test_per_token_fields_fill_under_tokens_held_already():
    """A resumed job's transcript holds its saved tokens without their log probabilities; the engine's first
    delta repeats those tokens with theirs: the field fills from the start, the tokens are not repeated."""
    t = Transcript([5, 6], "ab")
    new = t.add(
        Delta(0, [5, 6, 7], 0, "abc", None, {"logprobs": [[5, -1.0, []], [6, -2.0, []], [7, -3.0, []]]})
    )
    assert new.token_ids == [7] and t.token_ids == [5, 6, 7]
    assert [e[1] for e in t.fields["logprobs"]] == [-1.0, -2.0, -3.0]
    t.add(Delta(3, [8], 3, "d", "stop", {"logprobs": [[8, -4.0, []]]}))
    t.add(Delta(3, [8], 3, "d", "stop", {"logprobs": [[8, -4.0, []]]}))  # a repeat adds nothing
    assert [e[1] for e in t.fields["logprobs"]] == [-1.0, -2.0, -3.0, -4.0] and t.token_ids == [5, 6, 7, 8]


def test_a_delta_crosses_a_pipe_unchanged():
    """Pickled whole (a job's transcript crosses processes in tests and tools)."""
    import pickle

    delta = Delta(3, [5, 6], 10, "ab", "stop", {"logprobs": [[5, -0.5, []], [6, -1.0, []]]})
    for protocol in (2, pickle.HIGHEST_PROTOCOL):
        back = pickle.loads(pickle.dumps(delta, protocol=protocol))
        assert type(back) is Delta and back == delta and back.end == Position(5, 12)
