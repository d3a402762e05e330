"""Issue 43 item 3: tensor parallelism. Two ranks over gloo on the CPU: the tiny Llama's heads, MLP and KV cache
sharded, token-identical (float64) to one process under preemption, swap and recompute, on both CPU attention
paths; the ranks stop with the engine and a dead rank makes the engine raise; what cannot be sharded is refused
before any rank starts."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import time

import pytest
import torch
from transformers import AutoConfig

from batching import Engine, EngineConfig
from batching.collectives import RankFailure
from batching.tensor_parallel import RowParallelLinear, check_shardable
from tests.batching.conftest import TINY_CONFIGS, TRITON_PATH, greedy, random_prompts
from tests.batching.test_preemption import WORKLOAD, run_arrivals


def tensor_parallel_engine(llama_path: str, **kwargs) -> Engine:
    options = dict(model=llama_path, dtype="float64", device="cpu", tensor_parallel_size=2)
    return Engine(EngineConfig(**(options | kwargs)))


def wait_exited(processes: list[subprocess.Popen], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(p.poll() is not None for p in processes):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("backend", ["cpu_kernel", "torch"])
def test_token_identical_to_one_process_under_preemption_swap_and_recompute(llama_path, reference, backend):
    """A pool far smaller than the demand and a host pool too small for every victim: sequences are swapped out
    and in, others recomputed, and every request's greedy tokens are generate()'s in one process."""
    engine = tensor_parallel_engine(
        llama_path,
        attention_backend=backend,
        block_size=2,
        num_device_blocks=25,
        num_host_blocks=12,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    try:
        # sharded: each rank holds half of the heads, of the KV cache's heads and of the MLP
        # (on the CPU fused_layers.py runs each rank's q/k/v and its gate/up as one product each)
        attention = engine.model.model.layers[0].self_attn
        # 2 of 4 heads of 16, and 1 of 2 KV heads (K and V)
        assert attention.qkv_proj.out_features == (2 + 1 + 1) * 16
        assert isinstance(attention.o_proj, RowParallelLinear) and attention.o_proj.linear.in_features == 32
        assert engine.kv_cache.layers[0].num_kv_heads == 1  # 1 of 2 KV heads
        assert (
            engine.model.model.layers[0].mlp.gate_up_proj.out_features
            == 2 * TINY_CONFIGS["llama"]["intermediate_size"] // 2
        )

        prompts = random_prompts(30, [n for n, *_ in WORKLOAD])
        requests = [
            (f"r{i}", prompts[i], greedy(mt), prio, at) for i, (_, mt, prio, at) in enumerate(WORKLOAD)
        ]
        outputs = run_arrivals(engine, requests)
        for req_id, prompt, params, _, _ in requests:
            expected = reference(llama_path, tuple(prompt), params.max_tokens)
            assert outputs[req_id].token_ids == expected, f"{req_id} diverged"
        stats = engine.stats()
        assert stats["num_preemptions"] >= 4
        assert (
            stats["num_blocks_swapped_out"] > 0
            and stats["num_blocks_swapped_in"] == stats["num_blocks_swapped_out"]
        )
        assert stats["num_recomputed_tokens"] > 0
    finally:
        processes = engine.ranks.processes if engine.ranks else []
        engine.close()
    assert wait_exited(processes, 1.0), "close() left a rank running"
    assert [p.returncode for p in processes] == [0]  # it stopped when asked, not killed


@pytest.mark.skipif(torch.cuda.device_count() == 1, reason="2 ranks on CUDA need 2 GPUs")
def test_the_triton_path_runs_per_rank(llama_path, reference):
    """The step metadata the CUDA path packs (model_runner.MetadataPacker), rebuilt by each rank from rank 0's
    broadcast; on the CPU under Triton's interpreter (slow: a short run of chunks and decodes)."""
    engine = tensor_parallel_engine(
        llama_path, **TRITON_PATH[1], num_device_blocks=32, num_host_blocks=0, max_num_batched_tokens=8
    )
    try:
        prompts = random_prompts(31, [7, 3, 12])
        outputs = engine.generate(prompts, greedy(5))
        assert [o.token_ids for o in outputs] == [reference(llama_path, tuple(p), 5) for p in prompts]
    finally:
        engine.close()


def test_ranks_stop_when_the_engine_is_collected(llama_path):
    engine = tensor_parallel_engine(llama_path, num_device_blocks=16, num_host_blocks=0)
    assert engine.ranks is not None
    processes = list(engine.ranks.processes)
    assert all(p.poll() is None for p in processes)
    del engine
    gc.collect()
    assert wait_exited(processes), "a rank outlived its collected engine"


def test_a_dead_rank_makes_the_engine_raise_not_hang(llama_path):
    engine = tensor_parallel_engine(llama_path, num_device_blocks=16, num_host_blocks=0)
    try:
        assert engine.ranks is not None
        (rank,) = engine.ranks.processes
        os.kill(rank.pid, signal.SIGKILL)
        rank.wait(10)
        engine.add_request("a", [5, 6, 7], greedy(4))
        started = time.monotonic()
        with pytest.raises(RankFailure, match="rank 1 exited with code -9"):
            engine.step()
        assert time.monotonic() - started < 10
    finally:
        engine.close()


def test_what_cannot_be_sharded_is_refused_before_any_rank_starts(llama_path):
    # 4 query heads over 2 KV heads: 3 ranks split neither, 4 ranks not the KV heads
    with pytest.raises(
        ValueError, match=r"num_attention_heads \(4\) does not divide over tensor_parallel_size 3"
    ):
        tensor_parallel_engine(llama_path, tensor_parallel_size=3)
    with pytest.raises(
        ValueError, match=r"num_key_value_heads \(2\) does not divide over tensor_parallel_size 4"
    ):
        tensor_parallel_engine(llama_path, tensor_parallel_size=4)
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(tensor_parallel_size=2, async_scheduling=True)
    config = EngineConfig(model=llama_path, tensor_parallel_size=2, device="cpu")
    # no plan from transformers (GPT-2 declares none)
    with pytest.raises(ValueError, match="declares no tensor-parallel plan"):
        check_shardable(AutoConfig.for_model("gpt2", **TINY_CONFIGS["gpt2"]), config)
    # quantized weights
    quantized = AutoConfig.for_model(
        "llama",
        **TINY_CONFIGS["llama"],
        quantization_config={"quant_method": "bitsandbytes", "load_in_8bit": True},
    )
    with pytest.raises(ValueError, match="quantized weights cannot be sharded"):
        check_shardable(quantized, config)
    # layers sharded in a style genq does not apply (a fused projection: packed_colwise)
    fused = AutoConfig.for_model("llama", **TINY_CONFIGS["llama"])
    fused.base_model_tp_plan = {**fused.base_model_tp_plan, "layers.*.mlp.gate_up_proj": "packed_colwise"}
    with pytest.raises(ValueError, match="packed_colwise"):
        check_shardable(fused, config)
