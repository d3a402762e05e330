"""Tensor parallelism: one model's attention heads and MLP split over N ranks, by the plan transformers declares
for its architecture (`base_model_tp_plan` of its config: Llama's, Qwen's, Mistral's, Gemma's, ...).

genq reads that plan and applies its two styles itself, on plain tensors, to the model each rank loaded whole:

- "colwise" (q_proj, k_proj, v_proj, gate_proj, up_proj): rank r keeps rows [r * out / N, (r + 1) * out / N)
  of the weight, so its q/k/v compute heads [r * H / N, (r + 1) * H / N) and KV heads likewise (a query head's
  KV head is on its own rank: H and Hkv both divide by N), and its share of the MLP's width;
- "rowwise" (o_proj, down_proj): rank r keeps the matching columns; the ranks' partial products are summed
  (an all-reduce), then the bias is added once.

Everything else (embeddings, norms, the LM head) is whole on every rank. The attention function sees only its
rank's heads, and the KV cache each rank builds holds only those (the load-time probe reads its geometry from
the sharded model), under the block ids rank 0's block manager hands out.

Why not transformers' own `from_pretrained(tp_plan="auto")`: in transformers 5.23 it requires `accelerate`
(not one of genq's dependencies) and makes the weights DTensors, which the CPU's packed linears (cpu_linear.py)
do not take. What genq cannot shard is refused at load (`check_shardable`), before any rank starts.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from batching import state_layers
from batching.config import EngineConfig
from batching.model_probe import refusal
from batching.models import STATE_LAYER_TYPES
from batching.quantization import quantization_of

COLWISE, ROWWISE = "colwise", "rowwise"
REPLICATED = {"replicated_with_grad_allreduce"}  # whole on every rank: its forward is the same
STYLES = {COLWISE, ROWWISE} | REPLICATED


class RowParallelLinear(nn.Module):
    """A rowwise-sharded linear layer: this rank's columns of the weight, the ranks' products summed, the bias
    added once. `linear` is a plain nn.Linear without bias (the CPU's packed linears pack it like any other)."""

    def __init__(
        self, linear: nn.Linear, bias: torch.Tensor | None, all_reduce: Callable[[torch.Tensor], None]
    ):
        super().__init__()
        self.linear = linear
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.all_reduce = all_reduce

    @property
    def weight(self) -> torch.Tensor:  # what model code reads of a linear (its dtype, its device)
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)  # [..., out]: this rank's partial sum
        self.all_reduce(y)
        return y if self.bias is None else y + self.bias


def check_shardable(model_config, config: EngineConfig) -> None:
    """Refuse, with the reason, a model genq cannot shard over config.tensor_parallel_size ranks, or a device
    that lacks the ranks' GPUs. From the model's config alone: called before any rank starts."""
    n = config.tensor_parallel_size
    model_type = model_config.model_type
    text = model_config.get_text_config(decoder=True)
    if str(config.device).startswith("cuda:"):
        raise ValueError(
            f"device: {config.device!r} names one GPU; with tensor_parallel_size {n} rank r runs on cuda:r "
            "(choose the GPUs with CUDA_VISIBLE_DEVICES and set device 'cuda' or 'auto')"
        )
    if config.device != "cpu" and torch.cuda.is_available() and torch.cuda.device_count() < n:
        raise ValueError(
            f"tensor_parallel_size {n} needs {n} GPUs, one per rank; {torch.cuda.device_count()} are visible"
        )
    quantization = quantization_of(model_config)
    if quantization is not None:
        raise refusal(
            model_type,
            f"its {quantization} quantized weights cannot be sharded over ranks (tensor_parallel_size {n})",
        )
    plan = getattr(text, "base_model_tp_plan", None) or {}
    if not plan:
        raise refusal(
            model_type,
            f"transformers declares no tensor-parallel plan for it (base_model_tp_plan), so genq cannot shard it "
            f"over tensor_parallel_size {n} ranks",
        )
    unsupported = sorted({style for style in plan.values() if style not in STYLES})
    if unsupported:
        raise refusal(
            model_type,
            f"its tensor-parallel plan shards some layers in styles genq does not apply ({unsupported}; genq "
            f"shards {COLWISE!r} and {ROWWISE!r} linear layers)",
        )
    stateful = set(getattr(text, "layer_types", None) or ()) & (STATE_LAYER_TYPES - {"mlp", "moe"})
    if stateful:
        raise refusal(model_type, f"its state layers ({sorted(stateful)}) are not sharded over ranks")
    heads = text.num_attention_heads
    sizes = {
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(text, "num_key_value_heads", None) or heads,
        "intermediate_size": getattr(text, "intermediate_size", None),
    }
    for name, size in sizes.items():
        if isinstance(size, int) and size % n:
            raise refusal(
                model_type, f"its {name} ({size}) does not divide over tensor_parallel_size {n} ranks"
            )


def shard_model(model, rank: int, world_size: int, all_reduce: Callable[[torch.Tensor], None]) -> int:
    """Keep this rank's share of every linear layer the model's plan names (module docstring); returns how many.
    In place, before the model moves to its device: each rank's device only ever holds its shard."""
    model_type = model.config.model_type
    if state_layers.installed(model):
        raise refusal(model_type, "its state layers are not sharded over ranks")
    plan = model.config.get_text_config(decoder=True).base_model_tp_plan
    patterns = [(re.compile(re.escape(key).replace(r"\*", r"\d+")), style) for key, style in plan.items()]
    base = model.base_model
    count = 0
    for name, module in list(base.named_modules()):
        style = next((style for pattern, style in patterns if pattern.fullmatch(name)), None)
        if style is None or style in REPLICATED:
            continue
        if type(module) is not nn.Linear:
            raise refusal(
                model_type,
                f"its plan shards {name}, a {type(module).__name__}, where genq shards nn.Linear only",
            )
        if style == COLWISE:
            _keep_rows(module, rank, world_size, model_type, name)
        else:
            parent, _, attr = name.rpartition(".")
            bias = _keep_columns(module, rank, world_size, model_type, name)
            setattr(base.get_submodule(parent), attr, RowParallelLinear(module, bias, all_reduce))
        count += 1
    if not count:
        raise refusal(model_type, "its tensor-parallel plan names none of its linear layers")
    return count


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of `rank`: its own GPU (cuda:rank), or the CPU they all share."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def _keep_rows(linear: nn.Linear, rank: int, world_size: int, model_type: str, name: str) -> None:
    size = _share(linear.out_features, world_size, model_type, name)
    keep = slice(rank * size, (rank + 1) * size)
    linear.weight = nn.Parameter(linear.weight.data[keep].clone(), requires_grad=False)  # [out / N, in]
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data[keep].clone(), requires_grad=False)
    linear.out_features = size


def _keep_columns(
    linear: nn.Linear, rank: int, world_size: int, model_type: str, name: str
) -> torch.Tensor | None:
    """Keep this rank's columns of the weight; returns the bias, taken off the layer (added after the sum)."""
    size = _share(linear.in_features, world_size, model_type, name)
    columns = linear.weight.data[:, rank * size : (rank + 1) * size].clone()  # [out, in / N]
    linear.weight = nn.Parameter(columns, requires_grad=False)
    linear.in_features = size
    bias = None if linear.bias is None else linear.bias.data
    linear.register_parameter("bias", None)
    return bias


def _share(width: int, world_size: int, model_type: str, name: str) -> int:
    if width % world_size:
        raise refusal(model_type, f"{name}'s width ({width}) does not divide over {world_size} ranks")
    return width // world_size
