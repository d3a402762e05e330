"""Packed oneDNN linear layers on the CPU: the same products as F.linear, in float32/bfloat16 engines only,
and float32 greedy output still that of model.generate()."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from batching import Engine, EngineConfig, cpu_linear
from tests.batching.conftest import greedy, random_prompts, run_to_completion


def packed_modules(engine: Engine) -> list[nn.Module]:
    return [m for m in engine.model.modules() if isinstance(m, cpu_linear.PackedLinear)]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
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
    for dtype, packs in (("float32", True), ("bfloat16", True), ("float64", False)):
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
