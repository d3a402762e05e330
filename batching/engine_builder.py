"""Building an engine from its config, in the order each part needs the last: the model and its tokenizer on
their device (`load`), the attention path (`choose_attention`), then the caches sized from the memory left and
the scheduler and runner over them (`build`), and after the warm-up the CUDA graphs (`capture_graphs`).
Engine.__init__ calls these and keeps what they return."""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from batching import cpu_attention, cpu_linear, fused_layers, model_probe, state_layers, tensor_parallel
from batching.block_manager import BlockManager, blocks_for
from batching.collectives import Collectives
from batching.config import EngineConfig
from batching.cpu_attention import PagedAttentionKernel
from batching.cuda_graphs import StepGraphs
from batching.kv_cache import KVCache
from batching.model_runner import ModelRunner
from batching.models import load_model, load_model_config, load_tokenizer_for, resolve_device, resolve_dtype
from batching.scheduler import Scheduler
from batching.sizing import size_pools, trial_step_bytes
from batching.state_cache import StateCache
from batching.step_cost import attention_context_per_token

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadedModel:
    """The model on its device, its tokenizer, and what the engine reads of its config."""

    model: torch.nn.Module
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    eos_token_ids: set[int]
    max_model_len: int


@dataclass(slots=True)
class EngineParts:
    """The caches, sized for this device, and the scheduler and runner over them."""

    kv_cache: KVCache
    state_cache: StateCache | None
    block_manager: BlockManager
    scheduler: Scheduler
    runner: ModelRunner
    activation_bytes: int  # CUDA: what a full step takes beyond the weights, kept free
    num_device_blocks: int
    num_host_blocks: int


def load(config: EngineConfig, collectives: Collectives | None = None) -> LoadedModel:
    """`collectives`: this rank's, with tensor_parallel_size > 1: the model keeps this rank's shard
    (tensor_parallel.py), on this rank's device."""
    device = resolve_device(config.device)
    model_config = load_model_config(config)
    dtype = resolve_dtype(config.dtype, model_config, device)
    tokenizer = load_tokenizer_for(config)
    shard = None
    if collectives is not None:
        device = tensor_parallel.rank_device(device, collectives.rank)
        shard = functools.partial(
            tensor_parallel.shard_model,
            rank=collectives.rank,
            world_size=collectives.world_size,
            all_reduce=collectives.all_reduce,
        )
    model = load_model(config, device, dtype, model_config, shard)
    if config.cpu_fused_layers and device.type == "cpu":  # before packing: it merges q/k/v and gate/up
        _fuse_layers(model, dtype)
    if config.cpu_packed_linears and cpu_linear.available(dtype, device):
        cpu_linear.pack_linears(model)
    elif cpu_linear.lacks_bf16_arithmetic(dtype, device):
        log.warning(
            "bfloat16 on a CPU without bf16 arithmetic (no AVX-512 BF16 / AMX / AVX-NE-CONVERT): "
            "every product widens to float32 first, so float32 runs faster here (about 4x on a Zen 5 "
            "core): choose dtype=float32"
        )
    text_config = model.config.get_text_config(decoder=True)  # multimodal configs nest the decoder's
    return LoadedModel(
        model,
        tokenizer,
        device,
        dtype,
        text_config.vocab_size,
        _eos_ids(text_config, tokenizer),
        _max_model_len(config, text_config),
    )


def _fuse_layers(model: torch.nn.Module, dtype: torch.dtype) -> None:
    report = fused_layers.install(model, dtype)
    if report.num_fused:
        log.info("fused decoder layers: %s", ", ".join(f"{n} {name}" for name, n in report.fused.items()))
    for name, why in report.refused.items():
        log.info("%s layers run unfused: %s", name, why)


def choose_attention(
    config: EngineConfig, device: torch.device, dtype: torch.dtype
) -> tuple[str, PagedAttentionKernel | None]:
    """(the attention path, the CPU kernels if that path is theirs): config.attention_backend."""
    asked, cuda = config.attention_backend, device.type == "cuda"
    if asked == "cpu_kernel" and cuda:
        raise ValueError(
            "attention_backend: 'cpu_kernel' runs on the CPU only; on CUDA use 'triton' or 'torch'"
        )
    if asked == "triton" or (asked == "auto" and cuda):
        why_not = triton_unavailable(device, dtype)
        if why_not is None:
            return "triton", None
        if asked == "triton":
            raise ValueError(f"attention_backend: 'triton' cannot run here: {why_not}")
        log.warning("Triton attention unavailable (%s): using the slower torch path", why_not)
        return "torch", None
    if asked == "torch" or cuda or not config.cpu_attention_kernel:
        return "torch", None
    kernel = cpu_attention.load()  # logs why, if it can't be had
    if kernel is not None and kernel.supports(dtype, device):
        return "cpu_kernel", kernel
    if asked == "cpu_kernel":
        raise ValueError(f"attention_backend: the CPU kernels cannot run {dtype} here (see the log)")
    return "torch", None


def build(
    config: EngineConfig,
    loaded: LoadedModel,
    attention_backend: str,
    kernel: PagedAttentionKernel | None,
    collectives: Collectives | None = None,
) -> EngineParts:
    """The caches follow what the attention layers pass, not what the config names (model_probe.py); the
    device pool takes what the weights and one full step leave (sizing.py). With `collectives` (tensor
    parallel) every rank builds its own parts here, in step with the others (the shape forward sums over
    them), and the pools take the sizes every rank can hold (its own heads' KV, under rank 0's block ids)."""
    model, device, dtype = loaded.model, loaded.device, loaded.dtype
    geometry = model_probe.kv_geometry(model, device, loaded.max_model_len)
    state_geometry = state_layers.geometry(model)  # recorded by that forward; None: attention only
    block_bytes = KVCache.bytes_per_block(geometry.layers, config.block_size, dtype, config.kv_cache_dtype)
    num_state_slots = config.max_num_seqs if state_geometry else 0  # one per running sequence
    state_bytes = state_geometry.bytes_per_slot * num_state_slots if state_geometry else 0
    enable_prefix_caching = config.enable_prefix_caching
    if state_geometry and enable_prefix_caching:
        log.info(
            "prefix caching is off for %s: its state layers keep no per-block state a cached prefix "
            "could start from",
            config.model,
        )
        enable_prefix_caching = False
    activation_bytes = 0
    if device.type == "cuda" and config.num_device_blocks is None:
        activation_bytes = trial_step_bytes(config, loaded, attention_backend, geometry)
    num_device_blocks, num_host_blocks = size_pools(
        config, device, block_bytes, loaded.max_model_len, activation_bytes, state_bytes
    )
    if collectives is not None:
        num_device_blocks, num_host_blocks = _agree_pool_sizes(
            config, loaded, collectives, num_device_blocks, num_host_blocks
        )
    kv_cache = KVCache(
        geometry.layers,
        config.block_size,
        num_device_blocks,
        num_host_blocks,
        dtype,
        device,
        config.kv_cache_dtype,
    )
    if kernel is not None and device.type == "cpu":
        kv_cache.row_writer = kernel.write_rows
    num_host_state_slots = num_state_slots if num_host_blocks else 0
    state_cache = None
    if state_geometry:
        state_cache = StateCache(state_geometry, num_state_slots, num_host_state_slots, device)
        log.info(
            "state layers: %d keep %.1f KiB per sequence, in %d device + %d host slots",
            len(state_geometry.states_per_layer),
            state_geometry.bytes_per_slot / 1024,
            num_state_slots,
            num_host_state_slots,
        )
    block_manager = BlockManager(
        num_device_blocks,
        num_host_blocks,
        config.block_size,
        enable_prefix_caching,
        num_state_slots,
        num_host_state_slots,
        # the CPU's attention reads a sequence's blocks faster as one run of memory; a GPU's does not care,
        # and there the pool's exact LRU order serves the prefix cache
        contiguous=device.type == "cpu",
    )
    context_per_token = attention_context_per_token(model, geometry.query_width) if geometry.layers else None
    scheduler = Scheduler(config, block_manager, context_per_token, stateful=bool(state_geometry))
    runner = ModelRunner(
        model,
        kv_cache,
        config.block_size,
        device,
        kernel,
        geometry.mask_patterns,
        attention_backend,
        state_cache,
    )
    return EngineParts(
        kv_cache,
        state_cache,
        block_manager,
        scheduler,
        runner,
        activation_bytes,
        num_device_blocks,
        num_host_blocks,
    )


def capture_graphs(
    config: EngineConfig, loaded: LoadedModel, attention_backend: str, parts: EngineParts
) -> StepGraphs | None:
    """CUDA graphs of the forward for every step shape the runner will see (cuda_graphs.py), after the
    warm-up; None where steps run eagerly: not CUDA, not the Triton path, or state layers (they run per
    sequence in Python)."""
    if not (
        loaded.device.type == "cuda"
        and config.cuda_graphs
        and config.tensor_parallel_size == 1  # (the all-reduces are not captured)
        and attention_backend == "triton"
        and parts.state_cache is None
    ):
        return None
    graphs = StepGraphs(
        parts.runner,
        config.max_num_seqs,
        blocks_for(loaded.max_model_len, config.block_size),
        config.max_num_batched_tokens,
    )
    return graphs if graphs.capture() else None


def _agree_pool_sizes(
    config: EngineConfig, loaded: LoadedModel, collectives: Collectives, device_blocks: int, host_blocks: int
) -> tuple[int, int]:
    """The pool sizes every rank can hold. On the CPU the ranks share one memory that each sized from alone:
    a pool sized from memory is divided between them."""
    if loaded.device.type == "cpu":
        n = collectives.world_size
        if config.num_device_blocks is None:
            device_blocks = max(blocks_for(loaded.max_model_len, config.block_size), device_blocks // n)
        if config.num_host_blocks is None:
            host_blocks //= n
    agreed = collectives.agree_min([device_blocks, host_blocks])
    return agreed[0], agreed[1]


def triton_unavailable(device, dtype) -> str | None:
    """None if the Triton attention kernel can run on `device` in `dtype`, else why not."""
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (pip install triton)"
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            return "on the CPU it runs only under Triton's interpreter (TRITON_INTERPRET=1), for tests"
        if dtype == torch.bfloat16:
            return "Triton's interpreter computes bfloat16 wrongly"
    return None


def _eos_ids(model_config, tokenizer) -> set[int]:
    eos = getattr(model_config, "eos_token_id", None)
    ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _max_model_len(config: EngineConfig, model_config) -> int:
    limit = getattr(model_config, "max_position_embeddings", None) or getattr(
        model_config, "n_positions", None
    )
    if limit is not None and limit <= 0:  # xlnet: -1, no learned limit
        limit = None
    if config.max_model_len is None:
        if limit is None:
            raise ValueError(
                f"max_model_len: {model_config.model_type}'s config has no max_position_embeddings; set it"
            )
        return int(limit)
    if limit is not None and config.max_model_len > limit:
        raise ValueError(
            f"max_model_len ({config.max_model_len}) exceeds {model_config.model_type}'s "
            f"max_position_embeddings ({limit})"
        )
    return config.max_model_len
