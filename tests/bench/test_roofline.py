"""bench/roofline.py: a step's bytes and FLOPs, counted from the config, against a hand count and the
real transformers model; the device measurement; a scheduler output read as a step."""

from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForCausalLM

from bench.roofline import (
    DeviceRates,
    Step,
    measure_device,
    param_bytes,
    roofline,
    scheduled_step,
    step_bytes,
    step_flops,
    step_traffic,
)

# 2 layers, hidden 64, 4 query heads and 2 KV heads of 16, MLP 128, vocab 256, LM head untied
TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=256,
)
# by hand: embedding 256 x 64 = 16,384; a layer: q 64x64 + k 64x32 + v 64x32 + o 64x64 = 12,288, MLP
# 3 x 64 x 128 = 24,576, two norms 128: 36,992; final norm 64; LM head 16,384
# 16,384 + 2 x 36,992 + 64 + 16,384 = 106,816 parameters
TINY_PARAMS = 106_816
TINY_MATMUL = 2 * (12_288 + 24_576)  # 73,728: the layers' projections and MLP
# a decode of a sequence with 10 tokens cached, and the 5-token chunk that ends a new prompt: 2 rows
STEP = Step(cached=(10, 0), scheduled=(1, 5), rows=2)


def tiny_config(**overrides):
    return AutoConfig.for_model("llama", **{**TINY, **overrides})


def test_the_tiny_llama_by_hand():
    config = tiny_config()
    assert param_bytes(config, torch.float32) == 4 * TINY_PARAMS
    assert param_bytes(config, torch.bfloat16) == 2 * TINY_PARAMS
    # weights: every parameter but the embedding rows the step's 6 tokens do not look up: 16,384 - 6 x 64
    weights = (TINY_PARAMS - (16_384 - 6 * 64)) * 4
    # KV: 2 layers x (K, V) x 2 KV heads x 16 x 4 bytes = 512 bytes a token; read 11 + 5, written 6
    assert step_traffic(config, torch.float32, STEP) == (weights, 16 * 512, 6 * 512)
    assert step_bytes(config, torch.float32, STEP) == 363_264 + 8_192 + 3_072
    # FLOPs: 2 x 73,728 x 6 tokens; head 2 x 256 x 64 x 2 rows; attention: the decode attends 11 keys,
    # the chunk's queries 1 + 2 + ... + 5 = 15: 26 pairs x 4 x 4 heads x 16 x 2 layers
    assert step_flops(config, STEP) == 2 * TINY_MATMUL * 6 + 2 * 256 * 64 * 2 + 26 * 4 * 4 * 16 * 2
    assert step_flops(config, STEP) == 963_584


def test_a_tied_head_reads_the_whole_table_once():
    config = tiny_config(tie_word_embeddings=True)
    assert param_bytes(config, torch.float32) == 4 * (TINY_PARAMS - 16_384)
    assert step_traffic(config, torch.float32, STEP)[0] == 4 * (TINY_PARAMS - 16_384)


@pytest.mark.parametrize(
    "model_type,overrides",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True}),
        ("llama", {"attention_bias": True, "mlp_bias": True}),
        ("llama", {"head_dim": 32}),
        ("mistral", {}),
        ("qwen2", {}),
        ("qwen3", {"head_dim": 16}),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parameter_bytes_are_the_real_models(model_type, overrides, dtype):
    config = AutoConfig.for_model(model_type, **{**TINY, **overrides})
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    assert param_bytes(config, dtype) == sum(p.numel() * p.element_size() for p in model.parameters())


def test_an_architecture_outside_the_family_is_counted_on_the_meta_device():
    config = AutoConfig.for_model(
        "gpt_neox",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=256,
    )
    model = AutoModelForCausalLM.from_config(config)
    assert param_bytes(config, torch.float32) == sum(p.numel() * p.element_size() for p in model.parameters())


def test_the_flops_are_what_the_real_forward_multiplies():
    """A 7-token prompt from nothing, one logits row: the matmuls equal torch's count of the model's mm
    calls; eager attention multiplies all 7 x 7 (query, key) pairs where causal attention needs 28."""
    config = tiny_config()
    model = AutoModelForCausalLM.from_config(config).eval()
    model.set_attn_implementation("eager")
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=torch.arange(3, 10)[None], logits_to_keep=1)
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    step = Step(cached=(0,), scheduled=(7,), rows=1)
    attention = 4 * 4 * 16 * 28 * 2
    assert step_flops(config, step) - attention == counts["aten.mm"]
    assert attention == counts["aten.bmm"] * 28 // 49


def test_a_scheduler_output_is_read_as_a_step():
    def seq(computed, total):
        return SimpleNamespace(num_computed_tokens=computed, num_tokens=total)

    sched = SimpleNamespace(
        seqs=[seq(10, 11), seq(0, 40), seq(32, 40), seq(5, 6)],  # decode, first chunk, last chunk, nothing
        num_scheduled_tokens=[1, 32, 8, 0],
    )
    assert scheduled_step(sched) == Step(cached=(10, 0, 32), scheduled=(1, 32, 8), rows=2)
    assert scheduled_step(SimpleNamespace(seqs=[], num_scheduled_tokens=[])) is None


def test_the_bound_is_the_slower_of_bytes_and_flops_per_step():
    config = tiny_config()
    fast_memory = DeviceRates("x", "float32", 1e18, 1e9, 1e18, 1e18, 0, 0)
    slow_memory = DeviceRates("x", "float32", 1e6, 1e18, 1e6, 1e6, 0, 0)
    steps = [STEP, Step((11, 5), (1, 1), 2)]
    flops = sum(step_flops(config, s) for s in steps)
    moved = sum(step_bytes(config, torch.float32, s) for s in steps)
    assert roofline(config, torch.float32, steps, fast_memory)["bound_seconds"] == pytest.approx(flops / 1e9)
    slow = roofline(config, torch.float32, steps, slow_memory)
    assert slow["bound_seconds"] == pytest.approx(moved / 1e6)
    assert (slow["steps"], slow["tokens"], slow["bytes"], slow["memory_bound_steps"]) == (2, 8, moved, 2)


def test_the_device_is_measured():
    rates = measure_device("cpu", torch.float32, tensor_bytes=1 << 22, matmul_n=128, repeat=2)
    assert rates.bandwidth == max(rates.copy_bandwidth, rates.sum_bandwidth) > 1e8  # > 0.1 GB/s
    assert rates.matmul > 1e8


def test_gpu_check_heads_its_report_with_the_1b_workloads_fraction():
    from bench.gpu_check import markdown

    def fig(size, dtype, width, fraction):
        bench = dict(tok_s=100.0, seconds=2.0, attention="triton")
        entry = dict(
            steps=10, bytes=2e9, flops=1e12, bound_seconds=fraction * 2.0, genq_seconds=2.0, fraction=fraction
        )
        return dict(
            workload="record", requests=256, model_size=size, dtype=dtype, max_num_seqs=width, budget=2048,
            genq=bench, ratios={},
            roofline=dict(device=dict(device="cuda", dtype=dtype, bandwidth=4e12, matmul=7e14), systems={"genq": entry}),
        )  # fmt: skip

    report = markdown("GPU", None, [fig("record", "float32", 64, 0.9), fig("1b", "bfloat16", 256, 0.125)])
    assert (
        report.splitlines()[4]
        == "Roofline, 1B bfloat16 width 256: genq at **12.5%** of the bound (target >= 50%: not met)"
    )
    assert "| genq | 10 | 2.00 | 1.000 | 1.800 | 2.00 | **90.0%** |" in report
    assert "Roofline" not in markdown("GPU", None, [fig("record", "float32", 64, 0.9)]).splitlines()[4]
