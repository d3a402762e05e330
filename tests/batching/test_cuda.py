"""What only a CUDA device can show: decode steps replay captured graphs and stay exact, the host
pools are pinned, the KV pool leaves a full step's memory free. On a machine without CUDA every test
here is skipped, saying so; `make gpu-check` runs them on a GPU host (the exactness suites run there
on the device as well: conftest.ENGINE_PATHS)."""

from __future__ import annotations

import pytest
import torch

from batching import Engine, EngineConfig, SamplingParams
from tests.batching.conftest import CUDA, greedy, random_prompts, run_to_completion

pytestmark = pytest.mark.skipif(not CUDA, reason="no CUDA device here: run `make gpu-check` on a GPU host")


def cuda_engine(path: str, **config) -> Engine:
    return Engine(EngineConfig(model=path, dtype="float64", device="cuda", **config))


@pytest.mark.parametrize("num_requests", [1, 5, 16, 40])  # 5 and 40 replay a larger bucket, padded
def test_decode_steps_replay_graphs_and_stay_exact(llama_path, reference, num_requests):
    engine = cuda_engine(llama_path, max_num_seqs=64, max_num_batched_tokens=128)
    assert engine.runner.graphs is not None, "graphs were not captured"
    prompts = random_prompts(num_requests, [3 + 7 * i % 60 for i in range(num_requests)])
    outs = engine.generate(prompts, greedy(16))
    assert engine.stats()["num_graph_steps"] > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference(llama_path, tuple(prompt), 16)


def test_graphs_can_be_turned_off(llama_path, reference):
    engine = cuda_engine(llama_path, cuda_graphs=False)
    assert engine.runner.graphs is None
    prompts = random_prompts(3, [4, 30, 9])
    outs = engine.generate(prompts, greedy(12))
    assert engine.stats()["num_graph_steps"] == 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference(llama_path, tuple(prompt), 12)


def test_swaps_run_on_the_copy_stream_into_pinned_host_memory(llama_path, reference):
    engine = cuda_engine(
        llama_path,
        block_size=4,
        num_device_blocks=30,
        num_host_blocks=100,
        max_num_seqs=8,
        max_num_batched_tokens=32,
    )
    assert all(pool.is_pinned() for pool in engine.kv_cache.host_pools)
    assert engine.kv_cache.copy_stream is not None
    prompts = random_prompts(4, [1, 5, 17, 40, 33])
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(10), priority=9 - i)
    outs = run_to_completion(engine)
    assert engine.stats()["num_blocks_swapped_in"] > 0
    for i, prompt in enumerate(prompts):
        assert outs[f"r{i}"].token_ids == reference(llama_path, tuple(prompt), 10)


def test_the_pool_leaves_a_full_step_free(llama_path):
    """Sized from free memory with nothing held back (memory_utilization 1.0, no cap from
    max_num_seqs), the pool still leaves what a step at the configured width takes, measured by a
    trial step: a full-width step runs after the pool is allocated, where it would run out of memory
    if the pool had taken everything."""
    engine = Engine(
        EngineConfig(
            model=llama_path,
            dtype="float32",
            device="cuda",
            memory_utilization=1.0,
            max_num_seqs=1_000_000,
            max_num_batched_tokens=1024,
            num_host_blocks=0,
            cuda_graphs=False,
        )
    )
    assert engine.activation_bytes > 0
    free, total = torch.cuda.mem_get_info()
    assert (
        engine.block_manager.num_device_blocks
        * engine.kv_cache.bytes_per_block(engine.kv_cache.layers, engine.config.block_size, torch.float32)
        > total // 2
    )  # the pool took most of the device: the reserve is what kept the step's memory
    prompts = random_prompts(5, [1000] + [1] * 20)
    outs = engine.generate(prompts, greedy(2))
    assert all(len(out.token_ids) == 2 for out in outs)


@pytest.mark.parametrize("sampled", [False, True])
def test_async_steps_never_make_the_host_wait_for_the_device(llama_path, sampled):
    """With async scheduling on (CUDA's default), a step launches the next batch without any synchronizing
    call (torch's sync debug mode raises on one: a pageable copy, .item(), .tolist() of a device tensor);
    the only wait is for the last step's token copy, on its event."""
    engine = cuda_engine(llama_path, max_num_seqs=16, max_num_batched_tokens=64)
    assert engine.async_scheduling
    params = (
        SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
        if sampled
        else greedy(40)
    )
    for i, prompt in enumerate(random_prompts(6, [5, 9, 14, 3, 30, 22])):
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(6):  # every prompt in, decoding
        engine.step()
    before = engine.stats()["num_overlapped_steps"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(10):
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert engine.stats()["num_overlapped_steps"] - before == 10


def test_steps_with_prefill_chunks_replay_graphs_and_stay_exact(llama_path, reference):
    """Mixed steps (decodes + prefill chunks) replay the graphs captured by token count."""
    engine = cuda_engine(llama_path, max_num_seqs=16, max_num_batched_tokens=64, block_size=4)
    assert engine.runner.graphs is not None and engine.runner.graphs.mixed, "no mixed graphs captured"
    prompts = random_prompts(9, [3, 50, 7, 90, 12, 33, 4, 61])
    for i, prompt in enumerate(prompts[:2]):
        engine.add_request(f"r{i}", prompt, greedy(12))
    outs, step = {}, 0
    while engine.has_unfinished_requests() or step < len(prompts):
        if 2 <= step < len(prompts):
            engine.add_request(f"r{step}", prompts[step], greedy(12))
        outs.update({o.request_id: o for o in engine.step() if o.finished})
        step += 1
    assert engine.stats()["num_mixed_graph_steps"] > 3
    for i, prompt in enumerate(prompts):
        assert outs[f"r{i}"].token_ids == reference(llama_path, tuple(prompt), 12), f"r{i}"
