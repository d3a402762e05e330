"""Quantized checkpoints: what a checkpoint's `quantization_config` quantizes, and the refusal of those genq
cannot run exactly, decided from the config before any weight loads.

genq runs a quantized checkpoint through transformers' own quantized layers, like any other model code: a
weight-only quantization (torchao's int8, intx and float8 weight-only tensors, bitsandbytes 4-bit,
compressed-tensors weight-only schemes) dequantizes its weights and multiplies float activations, the same
products for one sequence alone as in a packed batch, so greedy tokens stay those of `model.generate()` on the
same quantized model, as they do for plain weights. A quantization that also rounds the *activations* to 8
bits as they are computed (torchao's dynamic- and static-activation configs, bitsandbytes' LLM.int8(),
compressed-tensors W8A8, transformers' fp8 and fbgemm_fp8, quanto with activations) cannot: a packed batch sums in another order
than one sequence alone (the last bits of float32 differ, as between batch sizes), and rounding to 8 bits
turns such a difference, where a value sits near the midpoint of two steps, into a whole step of 1/127 of
the row's range, which the following layers carry on. A tiny Llama under torchao's
Int8DynamicActivationInt8WeightConfig left `generate()`'s greedy tokens within 24 tokens on one prompt in
twelve, where its weight-only int8 twin and the plain model matched on all. Refused, with that reason.

On the CPU, torchao's Int4WeightOnlyConfig is refused too (none of its packings has a float32 CPU kernel:
IntxWeightOnlyConfig(weight_dtype=torch.int4) is torchao's int4 for the CPU), while transformers' fp8
checkpoints load there dequantized to plain weights (its own choice without a GPU), which runs as the plain
model. What transformers itself cannot load here (a quantizer whose package is missing, a kernel this device
lacks) is refused by models.load_model with transformers' own message. Once loaded, each kind of quantized
weight must multiply activations of the engine's dtype: torchao's int8 weights do in any float dtype, its
intx and float8 weights only in the dtype they were quantized from (`check_weights`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from batching.model_probe import refusal


@dataclass(frozen=True, slots=True)
class Quantization:
    """A checkpoint's quantization, as its config.json names it."""

    method: str  # transformers' quant_method: torchao, bitsandbytes, compressed-tensors, gptq, fp8, ...
    schemes: tuple[str, ...]  # what the method names its kinds (torchao's config classes, bnb's 4bit/8bit)
    activations: str | None  # which scheme rounds activations at run time (None: weight-only)

    def __str__(self) -> str:
        return f"{self.method} {', '.join(self.schemes)}" if self.schemes else self.method


# transformers' quant_methods whose activations are quantized as they are computed
ACTIVATION_METHODS = {
    "fp8": "transformers' fine-grained fp8 quantizes each activation group to float8 as it multiplies",
    "fbgemm_fp8": "fbgemm's fp8 linear quantizes each activation row to float8 as it multiplies",
}
# quant_methods transformers loads on the CPU dequantized to plain weights (quantizer_finegrained_fp8.py)
DEQUANTIZED_ON_CPU = {"fp8"}
# quantizations with no float32 kernel on the CPU: why, and what runs instead
NO_CPU_KERNEL = {
    "Int4WeightOnlyConfig": "torchao's Int4WeightOnlyConfig has no float32 kernel on the CPU (its plain and "
    "plain_int32 packings run on CUDA only, tile_packed_to_4d takes bfloat16 only); torchao's int4 for the CPU "
    "is IntxWeightOnlyConfig(weight_dtype=torch.int4)",
}


def quantization_of(model_config) -> Quantization | None:
    """The checkpoint's quantization (None: plain weights)."""
    config = getattr(model_config, "quantization_config", None)
    if config is None:
        return None
    if not isinstance(config, dict):
        config = config.to_dict()
    method = str(getattr(config.get("quant_method"), "value", config.get("quant_method")))
    if method == "torchao":
        return _torchao(config)
    if method == "bitsandbytes":
        return _bitsandbytes(config)
    if method == "compressed-tensors":
        return _compressed_tensors(config)
    activations = None if config.get("dequantize") else ACTIVATION_METHODS.get(method)
    if method == "quanto" and config.get("activations"):  # optimum-quanto's W8A8 / W8A-float8
        activations = f"quanto quantizes activations to {config['activations']} as it multiplies"
    return Quantization(method, (), activations)


def check_quantization(model_config, device: torch.device) -> None:
    """Refuse a quantization that rounds activations at run time, or has no kernel on `device` (module
    docstring)."""
    quantization = quantization_of(model_config)
    if quantization is None:
        return
    if device.type == "cpu":
        for scheme in quantization.schemes:
            if scheme in NO_CPU_KERNEL:
                raise refusal(
                    model_config.model_type, f"{NO_CPU_KERNEL[scheme]} (its checkpoint is {quantization})"
                )
        if quantization.method in DEQUANTIZED_ON_CPU:
            return
    if quantization.activations is None:
        return
    raise refusal(
        model_config.model_type,
        f"its {quantization} quantization quantizes activations as well as weights "
        f"({quantization.activations}): rounding activations to 8 bits turns the last-bit differences between "
        "a packed batch and a sequence alone into whole quantization steps, so greedy tokens would drift from "
        "generate()'s; genq runs weight-only quantizations exactly (docs/models.md, Quantized checkpoints)",
    )


def _torchao(config: dict) -> Quantization:
    """torchao's configs, by class name (`quant_type` maps module names, or "default", to a serialized
    config; older checkpoints name it by a string such as "int8_weight_only")."""
    quant_type = config.get("quant_type")
    names = sorted(set(_torchao_config_names(quant_type)))
    activated = [n for n in names if "activation" in n.lower()]
    return Quantization(
        "torchao",
        tuple(names),
        f"{activated[0]} quantizes each activation as it multiplies" if activated else None,
    )


def _torchao_config_names(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        kind = value.get("_type")
        if (
            isinstance(kind, str)
            and kind.endswith("Config")
            and kind not in ("FqnToConfig", "ModuleFqnToConfig")
        ):
            return [kind]
        return [name for inner in value.values() for name in _torchao_config_names(inner)]
    return []


def _bitsandbytes(config: dict) -> Quantization:
    if config.get("load_in_8bit") or config.get("_load_in_8bit"):
        return Quantization(
            "bitsandbytes",
            ("8bit",),
            "LLM.int8() quantizes each activation row to int8 as it multiplies, outliers apart",
        )
    kind = config.get("bnb_4bit_quant_type", "fp4")
    return Quantization("bitsandbytes", (f"4bit {kind}",), None)


def _compressed_tensors(config: dict) -> Quantization:
    """compressed-tensors' config groups: each names its weights' and its input activations' scheme."""
    groups = config.get("config_groups") or {}
    schemes, activated = [], None
    for name, group in sorted(groups.items()):
        weights, inputs = group.get("weights") or {}, group.get("input_activations")
        described = f"{name}: weights {_ct_args(weights)}"
        if inputs:
            described += f", input activations {_ct_args(inputs)}"
            activated = activated or (
                f"{name} quantizes its input activations ({_ct_args(inputs)}) as it multiplies"
            )
        schemes.append(described)
    return Quantization("compressed-tensors", tuple(schemes), activated)


def _ct_args(args: dict) -> str:
    kind = f"{args.get('type', '?')}{args.get('num_bits', '')}"
    dynamic = " dynamic" if args.get("dynamic") else ""
    return f"{kind} {args.get('strategy', '?')}{dynamic}"


def check_weights(model: nn.Module, dtype: torch.dtype, model_type: str) -> None:
    """Refuse a model whose quantized weights (tensor subclasses: torchao's) cannot multiply activations of
    `dtype`, found by one product of each kind of weight with a row of zeros, before the probe runs."""
    tried: set[tuple[type, torch.dtype]] = set()
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (
            not isinstance(module, nn.Linear)
            or type(weight) in (torch.Tensor, nn.Parameter)
            or weight is None
        ):
            continue
        if (type(weight), weight.dtype) in tried:
            continue
        tried.add((type(weight), weight.dtype))
        x = torch.zeros(1, module.in_features, dtype=dtype, device=weight.device)
        try:
            with torch.inference_mode():
                module(x)  # its own forward: bitsandbytes' Linear4bit multiplies its packed weight itself
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            raise refusal(
                model_type,
                f"its quantized weights ({type(weight).__name__}, dequantized to {weight.dtype}) do not multiply "
                f"{dtype} activations ({type(exc).__name__}: {str(exc).splitlines()[0][:120]}): load it with "
                f"dtype={str(weight.dtype).removeprefix('torch.')!r}",
            ) from exc
