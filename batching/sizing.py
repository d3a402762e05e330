"""How many KV blocks fit: explicit numbers are honoured exactly, None is sized from free memory."""

from __future__ import annotations

import logging

import torch

from batching.block_manager import blocks_for
from batching.config import EngineConfig

log = logging.getLogger(__name__)

CPU_MEMORY_SHARE = 0.25  # on the CPU the "device" pool shares RAM with everything else
HOST_MEMORY_SHARE = 0.25


def size_pools(
    config: EngineConfig, device: torch.device, block_bytes: int, max_model_len: int
) -> tuple[int, int]:
    """(num_device_blocks, num_host_blocks)."""
    # never more than max_num_seqs full-length sequences could use
    useful = config.max_num_seqs * blocks_for(max_model_len, config.block_size)
    if config.num_device_blocks is not None:
        device_blocks = config.num_device_blocks
    else:
        if device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(device)
            budget = free * config.memory_utilization
        else:
            budget = available_host_memory() * CPU_MEMORY_SHARE * config.memory_utilization
        device_blocks = min(useful, int(budget // block_bytes))
        device_blocks = max(device_blocks, blocks_for(max_model_len, config.block_size))
    if config.num_host_blocks is not None:
        host_blocks = config.num_host_blocks
    else:
        host_budget = available_host_memory() * HOST_MEMORY_SHARE
        host_blocks = min(device_blocks, int(host_budget // block_bytes))
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
