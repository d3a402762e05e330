"""How many KV blocks fit: explicit numbers are honoured exactly, None is sized from free memory."""

from __future__ import annotations

import logging

import torch

from batching import state_layers
from batching.block_manager import blocks_for
from batching.config import EngineConfig

log = logging.getLogger(__name__)

CPU_MEMORY_SHARE = 0.25  # on the CPU the "device" pool shares RAM with everything else
HOST_MEMORY_SHARE = 0.25
# On CUDA, memory the pool leaves to the driver even at memory_utilization 1.0: the kernels it loads
# after sizing (Triton compiles per shape, lazily), library workspaces, and the mapping of the pool
# itself. A pool of exactly the free bytes fails to allocate (an H200, 2026-11-26: 132.90 GiB asked,
# 132.90 GiB free).
CUDA_DRIVER_HEADROOM_SHARE = 0.01
CUDA_DRIVER_HEADROOM_MIN = 512 << 20


def size_pools(
    config: EngineConfig,
    device: torch.device,
    block_bytes: int,
    max_model_len: int,
    activation_bytes: int = 0,
    state_bytes: int = 0,
) -> tuple[int, int]:
    """(num_device_blocks, num_host_blocks). On CUDA the device pool takes its share of the memory
    left free after `activation_bytes`, what a step at the configured width needs beyond the weights
    (`trial_step_bytes`), kept free twice over when CUDA graphs keep a pool of their own, and after
    `state_bytes`, the state slots of a model with state layers (state_cache.py), and after the
    driver's headroom (CUDA_DRIVER_HEADROOM_*). A model with no attention layers (`block_bytes` 0)
    has blocks for bookkeeping only: as many as can be used."""
    # never more than max_num_seqs full-length sequences could use
    useful = config.max_num_seqs * blocks_for(max_model_len, config.block_size)
    if config.num_device_blocks is not None:
        device_blocks = config.num_device_blocks
    else:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            free -= max(CUDA_DRIVER_HEADROOM_MIN, int(total * CUDA_DRIVER_HEADROOM_SHARE))
            reserve = activation_bytes * (2 if config.cuda_graphs else 1)
            budget = free * config.memory_utilization - reserve
        else:
            budget = available_host_memory() * CPU_MEMORY_SHARE * config.memory_utilization
        budget -= state_bytes
        device_blocks = min(useful, int(budget // block_bytes)) if block_bytes else useful
        device_blocks = max(device_blocks, blocks_for(max_model_len, config.block_size))
    if config.num_host_blocks is not None:
        host_blocks = config.num_host_blocks
    else:
        host_budget = available_host_memory() * HOST_MEMORY_SHARE
        host_blocks = min(device_blocks, int(host_budget // block_bytes)) if block_bytes else device_blocks
    return device_blocks, host_blocks


def available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def trial_step_bytes(config, loaded, attention_backend: str, geometry) -> int:
    """CUDA: the memory one step at the configured width takes beyond the weights (activations, the
    logits of every row, softmax over them), measured by running one on a throwaway KV cache: a
    prefill chunk filling max_num_batched_tokens with max_num_seqs - 1 one-token sequences beside it.
    0 if the forward fails (the load-time probe then says why, as a refusal)."""
    from batching.kv_cache import KVCache
    from batching.model_runner import ModelRunner
    from batching.sampling_params import SamplingParams
    from batching.scheduler import SchedulerOutput
    from batching.sequence import Sequence
    from batching.state_cache import StateCache

    device, bs = loaded.device, config.block_size
    tokens = min(config.max_num_batched_tokens, loaded.max_model_len)
    n = max(1, min(config.max_num_seqs, tokens))
    lengths = [tokens - (n - 1)] + [1] * (n - 1)
    num_blocks = sum(blocks_for(n, bs) for n in lengths)
    cache = KVCache(geometry.layers, bs, num_blocks, 0, loaded.dtype, device, config.kv_cache_dtype)
    states = state_layers.geometry(loaded.model)  # a model with state layers: a slot per sequence
    state_cache = StateCache(states, n, 0, device) if states else None
    runner = ModelRunner(
        loaded.model, cache, bs, device, None, geometry.mask_patterns, attention_backend, state_cache
    )
    sched, first = SchedulerOutput(), 0
    for i, length in enumerate(lengths):
        seq = Sequence(f"trial-{i}", [3] * length, SamplingParams(max_tokens=1), 5, 0)
        seq.state_slot = i
        seq.block_table = list(range(first, first + blocks_for(length, bs)))
        first += len(seq.block_table)
        sched.add(seq, length)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    try:
        logits, _, _, _ = runner.execute(sched)
        assert logits is not None
        torch.softmax(logits.float(), dim=-1)
        torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 - the probe that follows reports the model's failure
        log.debug("trial step failed (%s); the pool is sized without it", exc)
        return 0
    finally:
        del cache, runner
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    log.info("a step of %d tokens and %d rows takes %.1f MiB beyond the weights", tokens, n, peak / 2**20)
    return peak
