"""A batch's `model` (OpenAI's Batch object) is the model of its requests, over the real app, Postgres and Redis
with a second model announced (tests/webapi/test_named_model.py's fleet): the model every line names, the fleet's
default when the lines name none, and null when the file mixes models (OpenAI takes one model a file; here each
output line names its own). Created, read back and listed alike.
"""

from __future__ import annotations

import pytest

from tests.webapi.test_named_model import WIDE, create_batch, fleet, line, wide_model  # noqa: F401

FILES = {
    "one named model": ([line(0, model=WIDE), line(1, model=WIDE)], WIDE),
    "none named: the default": ([line(0), line(1)], "tiny-llama"),
    "the default, named or not": ([line(0, model="tiny-llama"), line(1)], "tiny-llama"),
    "mixed": ([line(0, model=WIDE), line(1), line(2, model=WIDE)], None),
}


@pytest.mark.parametrize("lines, model", FILES.values(), ids=FILES.keys())
def test_a_batch_names_the_model_of_its_requests(fleet, auth, lines, model):  # noqa: F811
    app, _ = fleet
    client, headers = app.test_client(), auth()
    created = create_batch(client, headers, lines)
    assert created["status"] == "in_progress", created["errors"]
    assert created["model"] == model
    assert client.get(f"/v1/batches/{created['id']}", headers=headers).json["model"] == model
    listed = client.get("/v1/batches", headers=headers).json["data"]
    assert [b["model"] for b in listed if b["id"] == created["id"]] == [model]


def test_a_failed_batch_names_the_model_of_its_valid_lines(fleet, auth):  # noqa: F811
    app, _ = fleet
    client, headers = app.test_client(), auth()
    created = create_batch(client, headers, [line(0, model=WIDE), line(1, model=WIDE, max_tokens=0)])
    assert created["status"] == "failed" and created["errors"]["data"][0]["line"] == 2
    assert created["model"] == WIDE
