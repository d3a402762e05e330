"""contract/token_events.py: a token event decodes to what was encoded, whatever its fields."""

from __future__ import annotations

import math

import pytest

from contract.deltas import Delta
from contract.token_events import Status, decode, encode


@pytest.mark.parametrize(
    "event",
    [
        Delta(0, [5], 0, "Hi"),
        Delta(3, [], 7, "", "stop"),
        Delta(1, [2, 3], 4, 'é "q"\n', None, {"logprobs": [[2, -0.5, [[2, -0.5]]], [3, -math.inf, []]]}),
        Status("running"),
    ],
)
def test_an_event_decodes_to_what_was_encoded(event):
    back = decode(encode(event))
    assert type(back) is type(event) and back == event
    if isinstance(back, Delta):
        assert back.fields == event.fields and back.end == event.end


def test_an_older_workers_delta_without_fields_still_decodes():
    back = decode(b'[2,[9],5,"x","length"]')
    assert back == Delta(2, [9], 5, "x", "length") and back.fields is None
