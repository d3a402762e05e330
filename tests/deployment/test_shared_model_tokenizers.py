"""One tokenizer per model per host (issues 40 and 42): gunicorn's arbiter loads the tokenizer of every configured
model (MODEL and SERVED_MODELS) before it forks its workers (gunicorn.conf.py, load_tokenizer_before_fork), so a
fleet's second model costs one tokenizer on the host, not one in each worker (bench/api_memory.py --models).

Checked against a real gunicorn with two workers and a second model `wide` (a tokenizer of its own) in
SERVED_MODELS: once the workers are up, `wide`'s files are removed, and every worker still tokenizes for `wide` as
its tokenizer does: the workers hold the arbiter's copy and never read the files themselves (a worker that loaded
it on first use, as before, finds nothing to load).
"""

from __future__ import annotations

import shutil

import requests

from batching.tokenizer import byte_level_tokenizer
from tests.conftest import settings_env
from tests.deployment.test_shared_tokenizer import _tail, gunicorn_arbiter
from tests.webapi.test_named_model import MERGES

PROMPTS = [f"On the {i}th day, the heron went on." for i in range(24)]


def test_the_arbiter_loads_every_configured_models_tokenizer_once(settings, database, new_key, tmp_path):
    wide = tmp_path / "wide"
    tokenizer = byte_level_tokenizer(MERGES)
    tokenizer.save_pretrained(wide)
    workers = 2
    env = {**settings_env(settings), "API_ACCESS_LOG": "", "SERVED_MODELS": f"wide={wide}"}
    env["API_SHARED_TOKENIZER"] = "true"
    with gunicorn_arbiter(env, workers) as (url, arbiter, log):
        try:
            shutil.rmtree(wide)  # from now on, a worker loading `wide`'s tokenizer itself finds nothing
            headers = {"Authorization": f"Bearer {new_key()}"}
            for prompt in PROMPTS:  # a new connection each: gunicorn spreads them over its workers
                body = {"prompt": prompt, "model": "wide"}
                r = requests.post(f"{url}/tokenize", json=body, headers=headers, timeout=10)
                assert r.status_code == 200, r.text
                assert r.json()["tokens"] == tokenizer(prompt)["input_ids"]
        finally:
            arbiter.terminate()
            arbiter.wait(timeout=30)
        text = _tail(log, 100_000)
    assert arbiter.returncode == 0, text
    assert "after parallelism has already been used" not in text, text
