"""Many models, one fleet (issue 40), end to end: one API, two real Celery workers serving two different models
(the built-in tiny-llama, the fleet's default, and `small`: a saved tiny random Qwen2 with a tokenizer of its own
and a context of 1,024 tokens), real Postgres and Redis, the reconciler running as beat runs it.

- the fleet is known: GET /models, /v1/models and /v1/models/<id> list both with their live workers; an unknown
  model is 404 model_not_found naming the served ones; a prompt is counted and its length checked with the named
  model's tokenizer and context;
- jobs of both models at mixed priorities land on their model's worker, token-identical to that model's offline
  engine; an urgent job under a backlog of both models starts before its own model's backlog;
- `small`'s only worker killed mid-run: tiny-llama's jobs keep finishing, `small`'s wait (its status says no live
  worker, and so does a metric), then finish, token-identical, once a worker of `small` is back.
"""

from __future__ import annotations

import re
import time
import uuid

import pytest
from sqlalchemy import text as sql

from batching.tokenizer import BOS_ID, EOS_ID, byte_level_tokenizer
from contract.dispatch import jobs_in_queue, model_queue
from tests.reliability.conftest import FINISHED, Reconciler, Worker

SMALL = "small"
SMALL_LEN = 1024
# merges the second model's tokenizer makes on top of single bytes ("Ġ" is ByteLevel's space): its token counts
# differ from tiny-llama's byte-per-token ones
MERGES = [("o", "n"), ("h", "e"), ("Ġ", "t"), ("Ġt", "he"), ("Ġ", "a"), ("e", "r"), ("O", "n")]


def merged_tokenizer():
    """A byte-level BPE with seven merges (266 ids), BOS added, tiny-llama's chat template. Built locally."""
    return byte_level_tokenizer(MERGES)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> str:
    """The second model: a tiny random Qwen2 and its own tokenizer, saved to a directory (no download)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = merged_tokenizer()
    config = AutoConfig.for_model(
        "qwen2",
        vocab_size=len(tokenizer),
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=0,
        initializer_range=0.25,
        tie_word_embeddings=False,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SMALL_LEN,
        use_sliding_window=False,
    )
    torch.manual_seed(1)
    directory = tmp_path_factory.mktemp("small-model")
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


def offline(settings, prompts_and_params) -> list[list[int]]:
    """Each (prompt, SamplingParams) as the model of `settings` generates it alone, offline."""
    from batching import Engine, EngineConfig

    engine = Engine(EngineConfig(**settings.engine_options()))
    return [engine.generate([prompt], params)[0].token_ids for prompt, params in prompts_and_params]


def params_of(body: dict):
    from batching import SamplingParams

    return SamplingParams(
        max_tokens=body["max_tokens"], temperature=body.get("temperature", 1.0), seed=body.get("seed")
    )


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := predicate():
            return found
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout}s: {what}")


def claimed_by(worker: Worker, job_id: str) -> bool:
    return f"job {job_id} claimed" in worker.log_text()


def test_two_models_on_two_workers(settings, sessions, new_key, tmp_path, small_model, redis_client):
    from webapi import create_app

    with sessions.begin() as s:  # earlier tests' live jobs stay out of this fleet's queues
        s.execute(
            sql(
                "UPDATE jobs SET status = 'cancelled', finished_at = now(), lease_expires_at = NULL "
                "WHERE status IN ('queued', 'running')"
            )
        )
    fleet = settings.replace(
        redis_key_prefix=f"{settings.redis_key_prefix}fleet-{uuid.uuid4().hex[:6]}:",
        lease_seconds=2.0,
        progress_interval=0.2,
        reconcile_interval=0.5,
        fleet_heartbeat_seconds=0.5,
        max_num_seqs=2,
        worker_reserve=0,
        served_models=SMALL,  # served with no live worker too: its jobs wait for one
    )
    tiny_settings = fleet  # the default model: its queue is `generate`
    small_settings = fleet.replace(
        model=small_model, model_name=SMALL, default_model="tiny-llama", max_model_len=SMALL_LEN
    )
    app = create_app(fleet)
    client, headers = app.test_client(), {"Authorization": f"Bearer {new_key()}"}
    tiny, small = Worker(tiny_settings, tmp_path, 2), Worker(small_settings, tmp_path, 2)
    reconciler = Reconciler(sessions, fleet)

    def submit(**body) -> str:
        r = client.post("/jobs", json=body, headers=headers)
        assert r.status_code == 202, r.json
        return r.json["id"]

    def job(job_id: str) -> dict:
        return client.get(f"/jobs/{job_id}", headers=headers).json

    def served() -> dict:
        return {m["id"]: m for m in client.get("/models", headers=headers).json["models"]}

    try:
        tiny.start()
        small.start()
        reconciler.__enter__()

        # --- the fleet is known
        models = wait_for(
            lambda: (m := served()) and all(m[n]["status"] == "ready" for n in ("tiny-llama", SMALL)) and m,
            10,
            "both models ready",
        )
        assert models[SMALL]["queue"] == "generate.small" and models["tiny-llama"]["queue"] == "generate"
        assert models[SMALL]["root"] == small_model and models[SMALL]["max_model_len"] == SMALL_LEN
        assert models["tiny-llama"]["default"] and len(models[SMALL]["workers"]) == 1
        assert models[SMALL]["capacity"] == 2
        # each worker's intake consumes its model's queue (`celery inspect active_queues`, Flower's queue list)
        for worker, queue in ((small, "generate.small"), (tiny, "generate")):
            inspected = reconciler.celery.control.inspect(
                destination=[worker.node], timeout=5
            ).active_queues()
            assert [q["name"] for q in inspected[worker.node]] == [queue], inspected
        card = client.get(f"/v1/models/{SMALL}", headers=headers)
        assert card.status_code == 200 and card.json["root"] == small_model, card.json
        ids = {c["id"] for c in client.get("/v1/models", headers=headers).json["data"]}
        assert {"tiny-llama", SMALL} <= ids
        missing = client.get("/v1/models/nope", headers=headers)
        assert missing.status_code == 404 and missing.json["error"]["code"] == "model_not_found"
        unknown = client.post("/jobs", json={"prompt": "hi", "model": "nope"}, headers=headers)
        assert unknown.status_code == 404, unknown.json
        assert unknown.json["error"]["code"] == "model_not_found"
        assert (
            "`small`" in unknown.json["error"]["message"]
            and "`tiny-llama`" in unknown.json["error"]["message"]
        )
        # the named model's context and tokenizer
        too_long = client.post(
            "/jobs", json={"prompt": "Once upon", "model": SMALL, "max_tokens": 1020}, headers=headers
        )
        assert too_long.status_code == 422 and "max_model_len 1024" in too_long.json["error"]["message"]
        counted = client.post("/tokenize", json={"prompt": "Once upon", "model": SMALL}, headers=headers).json
        assert counted["max_model_len"] == SMALL_LEN
        assert counted["tokens"] == merged_tokenizer()("Once upon")["input_ids"]
        assert len(counted["tokens"]) < 1 + len(b"Once upon")  # tiny-llama's: BOS and a token a byte
        fits = client.post("/jobs", json={"prompt": "Once upon", "max_tokens": 1020}, headers=headers)
        assert fits.status_code == 202 and fits.json["model"] == "tiny-llama"  # tiny-llama's context: 2048
        assert client.post(f"/jobs/{fits.json['id']}/cancel", headers=headers).status_code == 200

        # --- mixed models and priorities, an urgent job of each under a backlog of both
        prompt = "Once upon a time there"
        backlog = [
            dict(prompt=f"{prompt} {i}", max_tokens=200, temperature=0.0, priority=5, model=m)
            for i in range(4)
            for m in ("tiny-llama", SMALL)
        ]
        backlog_ids = [submit(**body) for body in backlog]
        urgent = {
            m: dict(prompt=f"urgent {m}", max_tokens=8, temperature=0.7, seed=11, priority=0, model=m)
            for m in ("tiny-llama", SMALL)
        }
        urgent_ids = {m: submit(**body) for m, body in urgent.items()}
        # the backlog jobs of each model still waiting in Redis once the urgent ones were there (one taken
        # before, in a claim being written, is rightly ahead of them)
        unstarted = {
            m: [
                i
                for i in map(
                    str,
                    jobs_in_queue(
                        redis_client,
                        tiny_settings,
                        5,
                        [uuid.UUID(i) for i, b in zip(backlog_ids, backlog) if b["model"] == m],
                        queue=model_queue(tiny_settings, m),
                    ),
                )
            ]
            for m in urgent
        }
        everything = dict(zip(backlog_ids, backlog)) | {urgent_ids[m]: urgent[m] for m in urgent}
        ended = {
            i: wait_for(lambda i=i: (j := job(i))["status"] in FINISHED and j, 180, f"job {i}")
            for i in everything
        }
        assert all(j["status"] == "succeeded" for j in ended.values()), ended
        for m in urgent:
            started = ended[urgent_ids[m]]["started_at"]
            later = [ended[i]["started_at"] for i in unstarted[m]]
            assert later and all(started < s for s in later), (m, started, later)
        # each job on its model's worker, token-identical to that model's offline engine
        for i, body in everything.items():
            assert ended[i]["model"] == body["model"]
            assert claimed_by(small if body["model"] == SMALL else tiny, i), i
            assert not claimed_by(tiny if body["model"] == SMALL else small, i), i
        for settings_of, name in ((tiny_settings, "tiny-llama"), (small_settings, SMALL)):
            mine = [i for i, b in everything.items() if b["model"] == name]
            expected = offline(
                settings_of, [(everything[i]["prompt"], params_of(everything[i])) for i in mine]
            )
            assert [ended[i]["output"]["token_ids"] for i in mine] == expected, name
        # usage is counted with each model's tokenizer: the merges make `small`'s prompts shorter
        tiny_prompt = ended[backlog_ids[0]]["usage"]["prompt_tokens"]
        small_prompt = ended[backlog_ids[1]]["usage"]["prompt_tokens"]
        assert tiny_prompt == len(prompt.encode()) + 3 and small_prompt < tiny_prompt

        # --- `small`'s only worker killed mid-run: tiny-llama's jobs go on, small's wait, then finish
        smalls = [
            submit(prompt=f"small {i}", max_tokens=1000, temperature=0.0, model=SMALL) for i in range(3)
        ]
        tinies = [submit(prompt=f"tiny {i}", max_tokens=60, temperature=0.0) for i in range(4)]
        wait_for(lambda: any(job(i)["status"] == "running" for i in smalls), 60, "a small job running")
        small.kill9()
        left = [i for i in smalls if job(i)["status"] not in FINISHED]  # the kill's: they wait for a worker
        assert left, "every small job ended before the kill"
        done = {
            i: wait_for(lambda i=i: (j := job(i))["status"] in FINISHED and j, 120, f"job {i}")
            for i in tinies
        }
        assert all(j["status"] == "succeeded" for j in done.values())
        waiting = wait_for(
            lambda: (m := served()[SMALL])["status"] == "no_live_worker" and m, 10, "small gone"
        )
        assert waiting["workers"] == []
        metrics = client.get("/metrics").get_data(as_text=True)
        assert re.search(r'genq_model_live_workers\{model="small"\} 0', metrics), metrics[-2000:]
        time.sleep(fleet.lease_seconds + 1)  # leases lapsed, the reconciler has requeued them: they wait
        assert all(job(i)["status"] == "queued" for i in left), [job(i)["status"] for i in left]
        assert sum(served()[SMALL]["queued"].values()) >= len(left)  # in small's queue, none taken
        small.start()
        finished = {
            i: wait_for(lambda i=i: (j := job(i))["status"] in FINISHED and j, 120, f"job {i}")
            for i in smalls
        }
        assert all(j["status"] == "succeeded" for j in finished.values())
        expected = offline(
            small_settings,
            [(f"small {i}", params_of({"max_tokens": 1000, "temperature": 0.0})) for i in range(3)],
        )
        assert [finished[i]["output"]["token_ids"] for i in smalls] == expected
        expected_tiny = offline(
            tiny_settings,
            [(f"tiny {i}", params_of({"max_tokens": 60, "temperature": 0.0})) for i in range(4)],
        )
        assert [done[i]["output"]["token_ids"] for i in tinies] == expected_tiny
    finally:
        reconciler.__exit__()
        tiny.stop()
        small.stop()
        app.extensions["genq"].close()
