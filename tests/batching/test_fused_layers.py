"""Fused decoder layers on the CPU (batching/fused_layers.py).

The C++ passes compute what transformers' ops compute; a fused model's logits equal the unfused model's
(float64, float32 and bfloat16, for each architecture it fuses); the engine on the fused path gives
generate()'s greedy tokens in float64; layers it does not reproduce run unfused, with the reason.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama import modeling_llama

from batching import fused_layers
from tools import model_support as support

FUSED_TYPES = {
    "llama": "LlamaDecoderLayer",
    "mistral": "MistralDecoderLayer",
    "qwen2": "Qwen2DecoderLayer",
    "qwen3": "Qwen3DecoderLayer",
}
DTYPES = [torch.float64, torch.float32, torch.bfloat16]


def tiny_model(model_type: str, dtype: torch.dtype, **overrides):
    with support.quiet():
        model = support.build_tiny_model(support.tiny_config(model_type, **overrides))
    return model.to(dtype).eval()


def kernel_ops(dtype: torch.dtype) -> fused_layers.KernelOps:
    library = fused_layers.load_library()
    assert library is not None, "the fused-layer C++ passes did not build (a compiler is on PATH here)"
    return fused_layers.KernelOps(library, dtype)


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    """Equal up to the order of a float32 sum: the last bit or two of the dtype (an op run wrongly is off by
    far more than this)."""
    tol = {torch.float64: 1e-6, torch.float32: 1e-5, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_passes_compute_transformers_ops(dtype):
    torch.manual_seed(0)
    ops = kernel_ops(dtype)
    rows, hidden, heads, kv_heads, head_dim = 7, 96, 4, 2, 16
    x = torch.randn(rows, hidden, dtype=dtype) * 3
    residual = torch.randn(rows, hidden, dtype=dtype)
    norm = modeling_llama.LlamaRMSNorm(hidden, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, dtype=dtype))

        out, total = ops.rms_norm(x, norm.weight, 1e-5)
        assert total is None
        close(out, norm(x), dtype)
        out, total = ops.rms_norm(x, norm.weight, 1e-5, residual=residual)
        assert total is not None
        torch.testing.assert_close(total, residual + x, rtol=0, atol=0)  # one rounded add: exact
        close(out, norm(residual + x), dtype)

        gate_up = torch.randn(rows, 2 * hidden, dtype=dtype) * 4
        close(ops.silu_mul(gate_up), F.silu(gate_up[:, :hidden]) * gate_up[:, hidden:], dtype)

        width = (heads + 2 * kv_heads) * head_dim
        qkv = torch.randn(rows, width + 5, dtype=dtype)[
            :, :width
        ]  # rows strided, as a slice of a wider product
        angles = torch.randn(rows, head_dim // 2, dtype=torch.float64) * 10
        cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)
        sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)
        q = qkv[:, : heads * head_dim].view(1, rows, heads, head_dim).transpose(1, 2)
        k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(1, rows, kv_heads, head_dim)
        q_ref, k_ref = modeling_llama.apply_rotary_pos_emb(q, k.transpose(1, 2), cos[None], sin[None])
        v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
        ops.rope_(qkv, heads + kv_heads, head_dim, cos, sin)
        close(q, q_ref, dtype)
        close(k.transpose(1, 2), k_ref, dtype)
        assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # V is left alone

        head_norm = modeling_llama.LlamaRMSNorm(head_dim, eps=1e-6).to(dtype)
        head_norm.weight.copy_(torch.randn(head_dim, dtype=dtype))
        expected = head_norm(qkv[:, : heads * head_dim].reshape(rows, heads, head_dim)).reshape(rows, -1)
        untouched = qkv[:, heads * head_dim :].clone()
        ops.head_norm_(qkv, 0, heads, head_dim, head_norm.weight, 1e-6)
        close(qkv[:, : heads * head_dim], expected, dtype)
        assert torch.equal(qkv[:, heads * head_dim :], untouched)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_holds_torch_values_over_the_whole_range(dtype):
    """The C++ pass's exp is a polynomial with a clamp: far out, where exp(-x) overflows, SiLU is zero as torch's
    x / (1 + inf) is (the zero's sign may differ: the passes are built with -fno-signed-zeros); at inf and NaN it gives
    what torch gives. (At -inf torch's NaN is not promised: a gate of -inf is a model already broken.)"""
    ops = kernel_ops(dtype)
    gate = torch.cat([torch.linspace(-120, 120, 4801), torch.tensor([-1e30, -1e4, 1e4, 1e30])]).to(dtype)
    gate = torch.cat([gate, torch.tensor([float("inf"), float("nan")], dtype=dtype)])
    up = torch.randn(gate.shape[0], generator=torch.Generator().manual_seed(0)).to(dtype)
    rows = 3  # a row stride wider than its two halves, as a slice of a wider product
    gate_up = torch.cat([gate.expand(rows, -1), up.expand(rows, -1), torch.zeros(rows, 5, dtype=dtype)], 1)
    got = ops.silu_mul(gate_up[:, : 2 * gate.shape[0]])
    expected = (F.silu(gate) * up).expand(rows, -1)
    # bfloat16: rounds to torch's values
    tol = {torch.float64: 1e-13, torch.float32: 1e-6, torch.bfloat16: 0.0}[dtype]
    torch.testing.assert_close(got, expected, rtol=tol, atol=1e-30, equal_nan=True)
    # where exp(-x) overflows in this dtype (-1e4 and beyond in float64)
    far = (gate < 0) & (F.silu(gate) == 0)
    assert far.sum() >= 2 and torch.equal(got[:, far].abs(), torch.zeros_like(got[:, far]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("model_type", list(FUSED_TYPES))
def test_a_fused_model_computes_the_unfused_models_logits(model_type, dtype):
    model = tiny_model(model_type, dtype)
    fused = copy.deepcopy(model)
    report = fused_layers.install(fused, dtype)
    assert report.fused == {FUSED_TYPES[model_type]: 2} and not report.refused, report
    layer = fused.model.layers[0]
    assert type(layer).__name__ == f"Fused{FUSED_TYPES[model_type]}"
    assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "gate_proj")  # merged, released
    assert fused.num_parameters() == model.num_parameters()
    ids = torch.randint(3, model.config.vocab_size, (1, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids).logits.float()
        got = fused(ids).logits.float()
    # RMSNorm sums in float32 in both (transformers casts a float64 model's to float32), in another order
    scale = expected.abs().max().item()
    tol = {torch.float64: 2e-6, torch.float32: 2e-5, torch.bfloat16: 0.05}[dtype] * scale
    torch.testing.assert_close(got, expected, rtol=0, atol=tol)


@pytest.mark.parametrize("model_type", list(FUSED_TYPES))
def test_the_engine_on_the_fused_path_gives_generates_tokens(model_type, tmp_path, monkeypatch):
    reports = []

    def install(model, dtype):  # the engine's own call, its report kept
        reports.append(real(model, dtype))
        return reports[-1]

    real = fused_layers.install
    monkeypatch.setattr(fused_layers, "install", install)
    with support.quiet():
        result = support.check_model_type(model_type, str(tmp_path), engine_options=dict(device="cpu"))
    assert result.status == "identical", result.reason
    assert reports and all(r.fused == {FUSED_TYPES[model_type]: 2} for r in reports), reports


def test_layers_it_does_not_reproduce_run_unfused_with_the_reason(monkeypatch):
    gemma = tiny_model("gemma2", torch.float64)
    report = fused_layers.install(gemma, torch.float64)
    assert report.num_fused == 0
    assert (
        "Gemma2DecoderLayer is not a layer whose forward genq's fused layer reproduces"
        in (report.refused["Gemma2DecoderLayer"])
    )
    assert not any(type(m).__name__.startswith("Fused") for m in gemma.modules())

    def replaced(self, x):  # a forward of someone else's: the fused layer would not run it
        return self.down_proj(F.gelu(self.gate_proj(x)) * self.up_proj(x))

    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", replaced)
    llama = tiny_model("llama", torch.float64)
    report = fused_layers.install(llama, torch.float64)
    assert report.num_fused == 0
    assert "LlamaMLP.forward is not transformers' own" in report.refused["LlamaDecoderLayer"]
    assert hasattr(llama.model.layers[0].mlp, "gate_proj")


def test_a_silu_free_mlp_is_not_fused():
    model = tiny_model("llama", torch.float64, hidden_act="gelu")
    report = fused_layers.install(model, torch.float64)
    assert report.num_fused == 0
    assert "activation is GELUActivation, not SiLU" in report.refused["LlamaDecoderLayer"], report


def test_merged_projections_keep_each_ones_output_and_bias():
    torch.manual_seed(0)
    linears = [
        torch.nn.Linear(8, n, bias=b, dtype=torch.float64) for n, b in ((6, True), (4, False), (4, True))
    ]
    merged = fused_layers.merge_linears(linears)
    x = torch.randn(3, 8, dtype=torch.float64)
    torch.testing.assert_close(merged(x), torch.cat([lin(x) for lin in linears], dim=-1))
