"""Fused decoder layers on the CPU: a Llama-shaped layer in 12 calls instead of about 45.

transformers runs a Llama decoder layer as its modules wrote it: RMSNorm as ~7 element-wise ops in float32,
q, k and v as three products, RoPE as ~14 ops, gate and up as two products, SiLU and the product as two
more. On the CPU every op is a dispatch and a pass over the step's rows: at decode widths the passes are
small and their overhead adds up; at prefill widths each pass reads and writes the whole activation.

Here the layer runs as: RMSNorm (one C++ pass), one product for q, k and v together (their weights
concatenated once at load, so the CPU's packed linears pack one weight: cpu_linear.py), RoPE on q and k in
place (one pass; Qwen3's per-head q/k norms one pass each before it), attention as before (genq's paged
attention writes the KV and attends: this module leaves it alone), the output projection, the residual add
and RMSNorm (one pass), one product for gate and up, SiLU(gate) * up (one pass), the down projection, the
residual add. The C++ passes
(csrc/fused_ops.cpp, built and cached as the attention kernels are) round as transformers does at each op
(RMSNorm in float32, cast back, times the weight in the model's dtype; RoPE's products and sum each
rounded), so bfloat16 values stay those of the unfused layer up to the order of a sum; float16 (no C++
pass) runs the same formulas in torch.

Which layers: exactly transformers' own Llama, Mistral, Qwen2 and Qwen3 decoder layers, running their own
code (a class whose forward anything replaced is left alone), with plain (not quantized) q/k/v and
gate/up weights, a SiLU MLP and RMSNorms of their own module. Every other layer, and every model on
another device, runs unfused; `install` returns why for each class it left.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from batching import cpu_attention

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "fused_ops.cpp"
DTYPE_SUFFIXES = {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16"}
_I64, _F64, _PTR, _INT = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p, ctypes.c_int
RMS_NORM_ARGTYPES = [_PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _F64, _INT]
ROPE_ARGTYPES = [_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _INT]
SILU_MUL_ARGTYPES = [_PTR, _I64, _PTR, _I64, _I64, _I64, _INT]


@dataclass(frozen=True, slots=True)
class Spec:
    """What a supported layer class's attention passes beyond Llama's, and its modules' class names."""

    attention: str
    mlp: str
    norm: str
    # "module": attn.sliding_window; "config": config.sliding_window; None: none passed
    window: str | None = None
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head of q and of k before RoPE


SUPPORTED = {
    ("transformers.models.llama.modeling_llama", "LlamaDecoderLayer"): Spec("LlamaAttention", "LlamaMLP", "LlamaRMSNorm"),
    ("transformers.models.mistral.modeling_mistral", "MistralDecoderLayer"): Spec(
        "MistralAttention", "MistralMLP", "MistralRMSNorm", window="config"
    ),
    ("transformers.models.qwen2.modeling_qwen2", "Qwen2DecoderLayer"): Spec(
        "Qwen2Attention", "Qwen2MLP", "Qwen2RMSNorm", window="module"
    ),
    ("transformers.models.qwen3.modeling_qwen3", "Qwen3DecoderLayer"): Spec(
        "Qwen3Attention", "Qwen3MLP", "Qwen3RMSNorm", window="module", qk_norm=True
    ),
}  # fmt: skip


@dataclass(slots=True)
class FusionReport:
    """What `install` did: layers fused, per class, and why each class it left runs unfused."""

    fused: dict[str, int] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    norms: int = 0  # RMSNorm modules (the final norm among them) running as one C++ pass

    @property
    def num_fused(self) -> int:
        return sum(self.fused.values())


# --- the element-wise passes ------------------------------------------------------------------------------


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for gate_up = [gate | up], as transformers' MLP computes it, in torch (the dtypes with no
    C++ pass: KernelOps.silu_mul). Its values are transformers' own, to the bit."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class KernelOps:
    """The C++ passes for one dtype. Tensors are 2-D [rows, ...] with the last dim contiguous."""

    def __init__(self, library: ctypes.CDLL, dtype: torch.dtype):
        suffix = DTYPE_SUFFIXES[dtype]
        self._rms_norm = _function(library, f"genq_rms_norm_{suffix}", RMS_NORM_ARGTYPES)
        self._rope = _function(library, f"genq_rope_{suffix}", ROPE_ARGTYPES)
        self._silu_mul = _function(library, f"genq_silu_mul_{suffix}", SILU_MUL_ARGTYPES)

    def rms_norm(self, x, weight, eps: float, residual=None):
        """(RMSNorm(x [+ residual]), x + residual or None)."""
        out = torch.empty_like(x)
        total = None if residual is None else torch.empty_like(x)
        self._rms_norm(
            x.data_ptr(), x.stride(0),
            None if residual is None else residual.data_ptr(), 0 if residual is None else residual.stride(0),
            None if total is None else total.data_ptr(), 0 if total is None else total.stride(0),
            weight.data_ptr(), out.data_ptr(), out.stride(0), x.shape[0], 1, x.shape[1], eps,
            torch.get_num_threads(),
        )  # fmt: skip
        return out, total

    def head_norm_(self, x, start: int, heads: int, head_dim: int, weight, eps: float) -> None:
        """RMSNorm over each of `heads` heads from column `start` of x, in place."""
        ptr = x.data_ptr() + start * x.element_size()
        self._rms_norm(
            ptr, x.stride(0), None, 0, None, 0, weight.data_ptr(), ptr, x.stride(0), x.shape[0], heads, head_dim,
            eps, torch.get_num_threads(),
        )  # fmt: skip

    def silu_mul(self, gate_up):
        """SiLU(gate) * up for gate_up = [gate | up] in one pass, where torch makes two and a tensor between them
        (on the 2-core Intel Xeon, Cascade Lake, float32, two threads, the 8 layers of the bench's model between
        their products: 1.8-2.0 -> 1.1-1.2 ms a step at 64 rows, 9.6-9.9 -> 5.9-6.7 ms at 512; the pass is bound by
        its exp and division, where torch's second pass and its temporary cost as much again). Its exp is a
        polynomial, not torch's: values within 4e-7 relative of torch's in float32 and 3e-15 in float64 (a few
        ulps); bfloat16 rounds to torch's values."""
        rows, cols = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(rows, cols)
        self._silu_mul(
            gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), out.stride(0), rows, cols,
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def rope_(self, x, heads: int, head_dim: int, cos, sin) -> None:
        """RoPE on the first `heads` heads of each row of x, in place; cos, sin: [rows, head_dim]."""
        self._rope(
            x.data_ptr(), x.stride(0), heads, head_dim, cos.data_ptr(), sin.data_ptr(), cos.stride(0),
            x.shape[0], torch.get_num_threads(),
        )  # fmt: skip


class TorchOps:
    """The same passes as transformers' formulas in torch: where no C++ pass runs the dtype (float16)."""

    def rms_norm(self, x, weight, eps: float, residual=None):
        total = None if residual is None else residual + x
        h = x if total is None else total
        hs = h.to(torch.float32)
        hs = hs * torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + eps)
        return weight * hs.to(h.dtype), total

    def head_norm_(self, x, start: int, heads: int, head_dim: int, weight, eps: float) -> None:
        part = x[:, start : start + heads * head_dim].view(x.shape[0], heads, head_dim)
        hs = part.to(torch.float32)
        hs = hs * torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + eps)
        part.copy_(weight * hs.to(x.dtype))

    silu_mul = staticmethod(silu_mul)

    def rope_(self, x, heads: int, head_dim: int, cos, sin) -> None:
        part = x[:, : heads * head_dim].view(x.shape[0], heads, head_dim)
        half = head_dim // 2
        rotated = torch.cat((-part[..., half:], part[..., :half]), dim=-1)
        part.copy_(part * cos[:, None] + rotated * sin[:, None])


def _function(library: ctypes.CDLL, name: str, argtypes: list):
    fn = getattr(library, name)
    fn.argtypes, fn.restype = argtypes, None
    return fn


def ops_for(dtype: torch.dtype) -> KernelOps | TorchOps:
    library = load_library() if dtype in DTYPE_SUFFIXES else None
    return TorchOps() if library is None else KernelOps(library, dtype)


@functools.lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL | None:
    """csrc/fused_ops.cpp, built if need be into the attention kernels' cache folder; None (logged once) where
    it can't be had (the fused layers then run their passes in torch)."""
    try:
        return ctypes.CDLL(str(_build()))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("fused-layer C++ passes unavailable (%s): the fused layers run them in torch", exc)
        return None


def _build() -> Path:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise OSError("no C++ compiler on PATH (set CXX)")
    flags = cpu_attention.FLAGS
    key = hashlib.sha256(
        b"\0".join([SOURCE.read_bytes(), *(h.read_bytes() for h in cpu_attention.HEADERS), " ".join(flags).encode(),
                    compiler.encode(),
                    cpu_attention._cpu_signature().encode()])
    ).hexdigest()[:16]  # fmt: skip
    target = cpu_attention._cache_dir() / f"fused_ops-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run(
            [compiler, *flags, str(SOURCE), "-o", str(built)], capture_output=True, text=True, timeout=120
        )
        if result.returncode != 0:
            raise OSError(f"{compiler} failed: {result.stderr.strip()[-500:]}")
        os.replace(built, target)
    log.info("built the fused-layer C++ passes: %s", target)
    return target


# --- the layer ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Plan:
    """What a fused layer's forward needs, fixed at install."""

    ops: KernelOps | TorchOps
    spec: Spec
    heads: int
    kv_heads: int
    head_dim: int
    eps_in: float
    eps_post: float
    eps_q: float = 0.0
    eps_k: float = 0.0
    default_attention: Any = None  # the modeling module's eager_attention_forward


def fused_forward(
    self,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    past_key_values=None,
    use_cache: bool | None = False,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs,
) -> torch.Tensor:
    """The decoder layer's forward, as transformers' but in fused passes (the module docstring)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    plan: _Plan = self._genq_plan
    ops, attn, mlp = plan.ops, self.self_attn, self.mlp
    shape = hidden_states.shape
    h = hidden_states.reshape(-1, shape[-1])
    if not h.is_contiguous():
        h = h.contiguous()
    rows, heads, kv_heads, head_dim = h.shape[0], plan.heads, plan.kv_heads, plan.head_dim

    x, _ = ops.rms_norm(h, self.input_layernorm.weight, plan.eps_in)
    qkv = attn.qkv_proj(x)  # [rows, (H + 2 Hkv) D]
    if plan.spec.qk_norm:
        ops.head_norm_(qkv, 0, heads, head_dim, attn.q_norm.weight, plan.eps_q)
        ops.head_norm_(qkv, heads * head_dim, kv_heads, head_dim, attn.k_norm.weight, plan.eps_k)
    cos, sin = position_embeddings  # type: ignore[misc]
    if cos.dtype != qkv.dtype:
        raise RuntimeError(f"fused layer: RoPE tables in {cos.dtype} for a {qkv.dtype} model")
    cos, sin = cos.reshape(-1, head_dim), sin.reshape(-1, head_dim)
    if cos.shape[0] != rows:  # one position table for every sequence of a batch
        cos, sin = cos.repeat(rows // cos.shape[0], 1), sin.repeat(rows // sin.shape[0], 1)
    ops.rope_(qkv, heads + kv_heads, head_dim, cos.contiguous(), sin.contiguous())
    q_end, k_end = heads * head_dim, (heads + kv_heads) * head_dim
    head_shape = (*shape[:-1], -1, head_dim)
    q = qkv[:, :q_end].view(head_shape).transpose(1, 2)
    k = qkv[:, q_end:k_end].view(head_shape).transpose(1, 2)
    v = qkv[:, k_end:].view(head_shape).transpose(1, 2)
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, attn.layer_idx)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(
        attn.config._attn_implementation, plan.default_attention
    )
    window = plan.spec.window
    if window == "module":
        kwargs["sliding_window"] = attn.sliding_window
    elif window == "config":
        kwargs["sliding_window"] = getattr(attn.config, "sliding_window", None)
    kwargs.update(position_ids=position_ids, use_cache=use_cache)  # what the unfused layer passes on
    out, _ = attention(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling, **kwargs)
    o = attn.o_proj(out.reshape(rows, -1))

    x, h = ops.rms_norm(o, self.post_attention_layernorm.weight, plan.eps_post, residual=h)
    y = mlp.down_proj(ops.silu_mul(mlp.gate_up_proj(x)))
    return h.add_(y).view(shape)


def fused_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """An RMSNorm of a fused layer's module (the decoder's final norm) as one pass."""
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    out, _ = self._genq_ops.rms_norm(
        x if x.is_contiguous() else x.contiguous(), self.weight, self.variance_epsilon
    )
    return out.view(shape)


_FUSED_CLASSES: dict[type, type] = {}


def _fused_class(cls: type, forward=fused_forward) -> type:
    """`cls` with the fused forward (one subclass per class, so isinstance checks still hold)."""
    if cls not in _FUSED_CLASSES:
        _FUSED_CLASSES[cls] = type(
            f"Fused{cls.__name__}", (cls,), {"forward": forward, "__module__": __name__}
        )
    return _FUSED_CLASSES[cls]


def install(model: nn.Module, dtype: torch.dtype) -> FusionReport:
    """Fuse every decoder layer of `model` that this module reproduces (SUPPORTED); the report says which were
    fused and why each other class was not. Run it before the linears are packed (it merges their weights)."""
    report = FusionReport()
    ops = None
    norms: dict[tuple[str, str], KernelOps | TorchOps] = {}  # (module, RMSNorm class) of the fused layers
    for layer in list(model.modules()):
        cls = type(layer)
        if not cls.__name__.endswith("DecoderLayer") or cls.__module__ == __name__:
            continue
        spec = SUPPORTED.get((cls.__module__, cls.__name__))
        why = _why_not(layer, spec, dtype)
        if why is not None:
            report.refused.setdefault(cls.__name__, why)
            continue
        assert spec is not None
        ops = ops or ops_for(dtype)
        _fuse(layer, spec, ops)
        report.fused[cls.__name__] = report.fused.get(cls.__name__, 0) + 1
        norms[(cls.__module__, spec.norm)] = ops
    modules: list[Any] = list(model.modules())
    for module in modules:  # the decoder's final norm: one C++ pass too
        key = (type(module).__module__, type(module).__name__)
        if key in norms and type(module).forward.__qualname__ == f"{key[1]}.forward":
            module._genq_ops = norms[key]
            module.__class__ = _fused_class(type(module), fused_norm_forward)
            report.norms += 1
    return report


def _why_not(layer: Any, spec: Spec | None, dtype: torch.dtype) -> str | None:
    """None if `layer` can be fused, else why not."""
    cls = type(layer)
    if spec is None:
        names = ", ".join(sorted(name for _, name in SUPPORTED))
        return f"{cls.__name__} is not a layer whose forward genq's fused layer reproduces ({names})"
    attn: Any = getattr(layer, "self_attn", None)
    mlp: Any = getattr(layer, "mlp", None)
    norms = [getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
    if spec.qk_norm:
        norms += [getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]
    parts = [(layer, cls.__name__), (attn, spec.attention), (mlp, spec.mlp)] + [(n, spec.norm) for n in norms]
    for module, name in parts:
        if module is None or type(module).__name__ != name or type(module).__module__ != cls.__module__:
            return f"{cls.__name__} holds a {type(module).__name__} where transformers' layer has a {name}"
        weight = getattr(module, "weight", None) if name == spec.norm else None
        if weight is not None and weight.dtype != dtype:
            return f"its {name} weight is {weight.dtype}, not the model's {dtype}"
        forward = type(module).forward
        if (
            getattr(forward, "__module__", None) != cls.__module__
            or forward.__qualname__ != f"{name}.forward"
        ):
            return f"{name}.forward is not transformers' own (replaced by {forward.__qualname__})"
    projections: tuple[tuple[Any, tuple[str, ...]], ...] = (
        (attn, ("q_proj", "k_proj", "v_proj")),
        (mlp, ("gate_proj", "up_proj")),
    )
    for holder, linears in projections:
        for name in linears:
            linear = getattr(holder, name, None)
            if type(linear) is not nn.Linear or type(linear.weight) not in (torch.Tensor, nn.Parameter):
                return (
                    f"its {name} is not a plain linear layer ({type(linear).__name__}): quantized or replaced"
                )
            if linear.weight.dtype != dtype:
                return f"its {name} weight is {linear.weight.dtype}, not the model's {dtype}"
    if type(mlp.act_fn).__name__ not in ("SiLUActivation", "SiLU"):
        return f"its MLP's activation is {type(mlp.act_fn).__name__}, not SiLU"
    head_dim = attn.head_dim
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    widths = (q.weight.shape[0], k.weight.shape[0], v.weight.shape[0])
    if widths[0] % head_dim or widths[1] % head_dim or widths[1] != widths[2]:
        return f"its q/k/v widths {widths} are not whole heads of {head_dim}"
    if head_dim % 2:
        return f"its head size {head_dim} is odd"
    if mlp.gate_proj.weight.shape != mlp.up_proj.weight.shape:
        return "its gate and up projections differ in width"
    return None


def _fuse(layer: Any, spec: Spec, ops: KernelOps | TorchOps) -> None:
    attn, mlp = layer.self_attn, layer.mlp
    head_dim = attn.head_dim
    plan = _Plan(
        ops=ops,
        spec=spec,
        heads=attn.q_proj.weight.shape[0] // head_dim,  # (a tensor-parallel shard's: its own heads)
        kv_heads=attn.k_proj.weight.shape[0] // head_dim,
        head_dim=head_dim,
        eps_in=layer.input_layernorm.variance_epsilon,
        eps_post=layer.post_attention_layernorm.variance_epsilon,
        default_attention=getattr(sys.modules[type(layer).__module__], "eager_attention_forward", None),
    )
    if spec.qk_norm:
        plan.eps_q, plan.eps_k = attn.q_norm.variance_epsilon, attn.k_norm.variance_epsilon
    attn.qkv_proj = merge_linears([attn.q_proj, attn.k_proj, attn.v_proj])
    del attn.q_proj, attn.k_proj, attn.v_proj
    mlp.gate_up_proj = merge_linears([mlp.gate_proj, mlp.up_proj])
    del mlp.gate_proj, mlp.up_proj
    layer._genq_plan = plan
    layer.__class__ = _fused_class(type(layer))


def merge_linears(linears: list[nn.Linear]) -> nn.Linear:
    """One linear layer whose output is the given layers' outputs side by side (their weights stacked)."""
    weight = torch.cat([lin.weight.detach() for lin in linears], dim=0)
    has_bias = any(lin.bias is not None for lin in linears)
    merged = nn.utils.skip_init(
        nn.Linear, weight.shape[1], weight.shape[0], bias=has_bias, device=weight.device, dtype=weight.dtype
    )
    merged.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        biases = [
            lin.bias.detach() if lin.bias is not None else weight.new_zeros(lin.weight.shape[0])
            for lin in linears
        ]
        merged.bias = nn.Parameter(torch.cat(biases), requires_grad=False)
    return merged
