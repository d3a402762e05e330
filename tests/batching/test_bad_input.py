"""Bad input is a ValueError naming the field and the limit, raised before anything is scheduled; the
engine keeps serving the other requests."""

from __future__ import annotations

import time

import pytest

from batching import Engine, EngineConfig, SamplingParams
from tests.batching.conftest import greedy, random_prompts, run_to_completion

VOCAB = 259


@pytest.fixture(scope="module")
def engine():
    return Engine(
        EngineConfig(
            model="tiny-llama",
            dtype="float32",
            device="cpu",
            max_model_len=64,
            block_size=4,
            num_device_blocks=40,
            num_host_blocks=0,
        )
    )


@pytest.fixture(scope="module")
def good(engine):
    """A request and its output when run alone."""
    prompt = random_prompts(90, [7])[0]
    engine.add_request("good", prompt, greedy(5))
    return prompt, run_to_completion(engine)["good"].token_ids


@pytest.fixture()
def busy(engine, good):
    """A request in the middle of its decode while the bad ones arrive; it must finish as if alone."""
    prompt, expected = good
    engine.add_request("good", prompt, greedy(5))
    engine.step()
    before = (
        len(engine.requests),
        len(engine.scheduler.waiting),
        engine.block_manager.num_free_device_blocks,
    )
    yield
    after = (len(engine.requests), len(engine.scheduler.waiting), engine.block_manager.num_free_device_blocks)
    assert after == before, "a rejected request left something behind"
    assert run_to_completion(engine)["good"].token_ids == expected


@pytest.mark.parametrize(
    "prompt,match",
    [
        ("", r"prompt must not be empty"),
        ([], r"prompt must not be empty"),
        ([5, -1], r"prompt: token id -1 is outside the vocabulary \[0, 259\)"),
        ([5, VOCAB], r"prompt: token id 259 is outside the vocabulary \[0, 259\)"),
        ([5, 2.0], r"prompt: token id 2.0 is outside the vocabulary"),
        ([True], r"prompt: token id True is outside the vocabulary"),
        (12, r"prompt must be a string or a list of token ids"),
        (list(range(3, 60)), r"prompt \(57 tokens\) \+ max_tokens \(8\) = 65 exceeds max_model_len \(64\)"),
        ("x" * 70, r"prompt \(71 tokens\) \+ max_tokens \(8\) = 79 exceeds max_model_len \(64\)"),
    ],
)
def test_bad_prompt(engine, busy, prompt, match):
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompt, SamplingParams(max_tokens=8))


def test_duplicate_request_id(engine, busy):
    with pytest.raises(ValueError, match=r"request_id 'good' is already in use"):
        engine.add_request("good", [5, 6], greedy(2))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(request_id=""), r"request_id must be a non-empty string"),
        (dict(request_id=7), r"request_id must be a non-empty string"),
        (dict(priority=10), r"priority must be an integer from 0 \(most urgent\) to 9, got 10"),
        (dict(priority=-1), r"priority must be an integer from 0 \(most urgent\) to 9, got -1"),
        (dict(priority=1.5), r"priority must be an integer"),
        (dict(params={"max_tokens": 3}), r"params must be a SamplingParams"),
        (dict(resume_token_ids=[5, 300]), r"resume_token_ids: token id 300 is outside the vocabulary"),
        (dict(resume_token_ids=[5, 6, 7]), r"resume_token_ids: 3 tokens already reach max_tokens \(3\)"),
        (
            dict(predicted_output_tokens=-1),
            r"predicted_output_tokens must be an integer >= 0 or None, got -1",
        ),
        (
            dict(predicted_output_tokens=2.5),
            r"predicted_output_tokens must be an integer >= 0 or None, got 2.5",
        ),
        (
            dict(deadline=float("nan")),
            r"deadline must be seconds since the epoch \(a finite number\) or None",
        ),
        (dict(deadline="tomorrow"), r"deadline must be seconds since the epoch .* got 'tomorrow'"),
    ],
)
def test_bad_request_fields(engine, busy, kwargs, match):
    args = dict(request_id="bad", prompt=[5, 6], params=greedy(3)) | kwargs
    with pytest.raises(ValueError, match=match):
        engine.add_request(args.pop("request_id"), args.pop("prompt"), args.pop("params"), **args)


def test_request_larger_than_the_device_pool():
    engine = Engine(
        EngineConfig(
            model="tiny-llama",
            dtype="float32",
            device="cpu",
            block_size=4,
            num_device_blocks=3,
            num_host_blocks=0,
        )
    )
    # 13 tokens need KV for 12 (the last is never fed back): exactly the pool
    engine.add_request("fits", [5] * 9, greedy(4))
    assert len(run_to_completion(engine)["fits"].token_ids) == 4
    with pytest.raises(
        ValueError, match=r"needs more KV blocks than the device pool holds \(3 blocks of 4\)"
    ):
        engine.add_request("too-big", [5] * 10, greedy(4))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-0.1), r"temperature must be a finite number >= 0, got -0.1"),
        (dict(temperature=float("nan")), r"temperature must be a finite number >= 0"),
        (dict(temperature=float("inf")), r"temperature must be a finite number >= 0"),
        (dict(temperature="hot"), r"temperature must be a finite number >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
        (dict(top_p=-0.2), r"top_p must be in \(0, 1\]"),
        (dict(top_p=float("nan")), r"top_p must be in \(0, 1\]"),
        (dict(max_tokens=0), r"max_tokens must be an integer >= 1, got 0"),
        (dict(max_tokens=-3), r"max_tokens must be an integer >= 1, got -3"),
        (dict(max_tokens=2.5), r"max_tokens must be an integer >= 1"),
        (dict(max_tokens=True), r"max_tokens must be an integer >= 1"),
        (dict(top_k=-1), r"top_k must be an integer >= 0"),
        (dict(seed=1.5), r"seed must be an integer or None"),
        (dict(stop=[""]), r"stop must be a list of non-empty strings"),
        (dict(stop=[3]), r"stop must be a list of non-empty strings"),
        (dict(stop_token_ids=[-1]), r"stop_token_ids must be a list of non-negative integers"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_stop_as_a_single_string_is_accepted():
    assert SamplingParams(stop="END").stop == ["END"]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(model=""), r"model must be a non-empty string"),
        (
            dict(dtype="float8"),
            r"dtype must be one of \('auto', 'float32', 'float64', 'bfloat16', 'float16'\)",
        ),
        (dict(device="tpu"), r"device must be one of \('auto', 'cpu', 'cuda'\)"),
        (dict(block_size=0), r"block_size must be an integer >= 1, got 0"),
        (dict(block_size=2.0), r"block_size must be an integer >= 1, got 2.0"),
        (dict(num_device_blocks=0), r"num_device_blocks must be an integer >= 1, got 0"),
        (dict(num_host_blocks=-1), r"num_host_blocks must be an integer >= 0, got -1"),
        (dict(max_num_seqs=0), r"max_num_seqs must be an integer >= 1, got 0"),
        (dict(max_num_batched_tokens=0), r"max_num_batched_tokens must be an integer >= 1, got 0"),
        (dict(max_model_len=1), r"max_model_len must be an integer >= 2, got 1"),
        (dict(preemption_mode="drop"), r"preemption_mode must be one of \('swap', 'recompute'\), got 'drop'"),
        (dict(enable_chunked_prefill="yes"), r"enable_chunked_prefill must be True or False"),
        (dict(memory_utilization=0), r"memory_utilization must be in \(0, 1\], got 0"),
        (dict(memory_utilization=1.5), r"memory_utilization must be in \(0, 1\], got 1.5"),
        (dict(memory_utilization="most"), r"memory_utilization must be in \(0, 1\]"),
        (dict(seed=-1), r"seed must be an integer >= 0, got -1"),
        (dict(revision=""), r"revision must be a non-empty string or None"),
        (dict(trust_remote_code="no"), r"trust_remote_code must be True or False"),
        (
            dict(scheduling_policy="sjf"),
            r"scheduling_policy must be one of \('fcfs', 'predicted', 'preemptive'\), got 'sjf'",
        ),
        (dict(aging_seconds=-1), r"aging_seconds must be a finite number of seconds >= 0, got -1"),
        (dict(cost_seconds_per_token=float("inf")), r"cost_seconds_per_token must be a finite number"),
        (dict(deadline_margin_seconds="5"), r"deadline_margin_seconds must be a finite number of seconds"),
    ],
)
def test_bad_engine_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_max_model_len_over_the_models_limit():
    with pytest.raises(
        ValueError, match=r"max_model_len \(4096\) exceeds llama's max_position_embeddings \(2048\)"
    ):
        Engine(EngineConfig(model="tiny-llama", device="cpu", max_model_len=4096, num_device_blocks=8))


@pytest.mark.parametrize("model", ["no-such/model", "/no/such/directory", "not a model id!"])
def test_unknown_model_fails_fast(model):
    """No network here: the answer must come at once, not after the Hub client's retries."""
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"model: .* not the built-in 'tiny-llama'"):
        Engine(EngineConfig(model=model, device="cpu"))
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("kwargs", [dict(num_device_blocks=1, block_size=1), dict(max_model_len=2)])
def test_smallest_valid_configs_construct_and_serve(kwargs):
    """The engine's own warm-up request must fit any configuration that validation accepts."""
    engine = Engine(EngineConfig(model="tiny-llama", dtype="float32", device="cpu", **kwargs))
    out = engine.generate([[5]], greedy(1))[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"


def test_generate_with_one_bad_prompt_queues_nothing(engine):
    with pytest.raises(ValueError, match=r"prompt: token id 999"):
        engine.generate([[5, 6], [5, 999], [7]], greedy(3))
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_device_blocks == engine.block_manager.num_device_blocks
    assert [len(o.token_ids) for o in engine.generate([[5, 6], [7]], greedy(3))] == [3, 3]
