"""Packed oneDNN linear layers on the CPU: the same products as F.linear, in float32/bfloat16 engines only,
and float32 greedy output still that of model.generate()."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from batching import Engine, EngineConfig, cpu_linear
from tests.batching.conftest import greedy, random_prompts, run_to_completion


def packed_modules(engine: Engine) -> list[nn.Module]:
    return [m for m in engine.model.modules() if isinstance(m, cpu_linear.PackedLinear)]


BF16_PACKS = torch.bfloat16 in cpu_linear.packable_dtypes()
NO_BF16 = "this CPU has no oneDNN bf16 path (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)"


@pytest.mark.parametrize(
    "dtype,tol",
    [
        (torch.float32, 1e-5),
        pytest.param(torch.bfloat16, 1e-2, marks=pytest.mark.skipif(not BF16_PACKS, reason=NO_BF16)),
    ],
)
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_computes_what_f_linear_does(dtype, tol, rows, bias):
    torch.manual_seed(0)
    layer = nn.Linear(96, 200, bias=bias).to(dtype)
    x = torch.randn(1, rows, 96, dtype=dtype)
    expected = F.linear(x, layer.weight, layer.bias)
    assert cpu_linear.pack_linears(layer) == 1
    assert isinstance(layer, cpu_linear.PackedLinear)
    with torch.inference_mode():
        got = layer(x)
        strided = layer(torch.randn(96, rows, dtype=dtype).t()[None])  # a non-contiguous input
    assert got.shape == expected.shape == (1, rows, 200)
    assert strided.shape == (1, rows, 200)
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


def test_float32_and_bfloat16_engines_pack_their_linears_and_float64_does_not(llama_path):
    """bfloat16 packs where this CPU's oneDNN has a bf16 path; elsewhere its engine still builds."""
    for dtype, packs in (("float32", True), ("bfloat16", BF16_PACKS), ("float64", False)):
        engine = Engine(EngineConfig(model=llama_path, dtype=dtype, device="cpu"))
        linears = [m for m in engine.model.modules() if isinstance(m, nn.Linear)]
        assert linears and (len(packed_modules(engine)) == len(linears)) == packs, dtype
    off = Engine(EngineConfig(model=llama_path, dtype="float32", device="cpu", cpu_packed_linears=False))
    assert not packed_modules(off)


def test_float32_greedy_tokens_match_generate_with_packed_linears(llama_path):
    """The packed path sums in another order than MKL: the greedy tokens must not change for it."""
    engine = Engine(EngineConfig(model=llama_path, dtype="float32", device="cpu", max_num_batched_tokens=64))
    assert packed_modules(engine), "the test must run the packed path"
    calls = []
    handle = packed_modules(engine)[0].register_forward_hook(lambda *a: calls.append(1))
    prompts = random_prompts(17, [1, 5, 17, 40, 130])
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(16))
    outputs = run_to_completion(engine)
    handle.remove()
    assert calls
    model = AutoModelForCausalLM.from_pretrained(llama_path, dtype=torch.float32).eval()
    for i, p in enumerate(prompts):
        ids = torch.tensor([p])
        ref = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=16,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(p) :].tolist()
        assert outputs[f"r{i}"].token_ids == ref, f"prompt of {len(p)} tokens diverged"


def test_cpu_packed_linears_must_be_a_bool():
    with pytest.raises(ValueError, match="cpu_packed_linears must be True or False"):
        EngineConfig(cpu_packed_linears="yes")


def test_packing_releases_the_weights_no_other_module_holds():
    """The packed copy replaces an unshared weight's memory; a tied one (lm_head = embeddings) stays."""
    torch.manual_seed(0)
    embed, head, proj = nn.Embedding(50, 16), nn.Linear(16, 50, bias=False), nn.Linear(16, 16)
    head.weight = embed.weight
    model = nn.ModuleDict({"embed": embed, "head": head, "proj": proj})
    x = torch.randn(3, 16)
    with torch.no_grad():
        expected_head, expected_proj, expected_row = head(x), proj(x), embed(torch.tensor([3]))
    assert cpu_linear.pack_linears(model) == 2
    assert proj.weight.shape == (16, 16) and proj.weight.dtype == torch.float32
    assert proj.weight.untyped_storage().nbytes() == 4, "the unshared weight was kept"
    assert head.weight is embed.weight and embed.weight.untyped_storage().nbytes() == 50 * 16 * 4
    with torch.inference_mode():
        torch.testing.assert_close(head(x), expected_head)
        torch.testing.assert_close(proj(x), expected_proj)
        torch.testing.assert_close(embed(torch.tensor([3])), expected_row)


@pytest.mark.skipif(BF16_PACKS, reason="this CPU packs bfloat16: the fallback is not taken here")
def test_bfloat16_linears_stay_unpacked_where_onednn_has_no_bf16_path():
    """On an AVX2-only CPU oneDNN refuses to pack bf16 weights: the layers keep torch's F.linear."""
    layer = nn.Linear(16, 8).to(torch.bfloat16)
    assert not cpu_linear.available(torch.bfloat16, torch.device("cpu"))
    assert cpu_linear.pack_linears(layer) == 0 and type(layer) is nn.Linear


def test_a_bfloat16_engine_warns_where_the_cpu_has_no_bf16_arithmetic(llama_path, caplog):
    """Where oneDNN has no bf16 path, bf16 is several times slower than float32: the log says so."""
    with caplog.at_level(logging.WARNING, logger="batching.engine"):
        Engine(EngineConfig(model=llama_path, dtype="bfloat16", device="cpu"))
    assert ("bfloat16 on a CPU without bf16 arithmetic" in caplog.text) == (not BF16_PACKS)


def test_a_quantized_weight_keeps_its_own_product():
    """torchao's int8 weight (a tensor subclass over int8 data) has no oneDNN packed layout: the layer is
    left as it is, computing what it computed before (packing it once crashed the engine at load)."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 16))
    quantize_(model[0], Int8WeightOnlyConfig())
    x = torch.randn(5, 64)
    with torch.inference_mode():
        expected = model(x)
    assert not cpu_linear.plain_weight(model[0].weight, cpu_linear.DTYPES)
    assert cpu_linear.pack_linears(model) == 1  # the plain one only
    assert type(model[0]) is nn.Linear and isinstance(model[1], cpu_linear.PackedLinear)
    with torch.inference_mode():
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
