"""Issue 43 item 2: the 8-bit KV cache, EngineConfig(kv_cache_dtype="int8") (batching/kv_cache.py).

Approximate by design (its error against the full-precision cache is measured in bench/quantized.py,
not here), so these tests check what must hold exactly: the quantization's bounds, the memory it saves
(about twice the blocks of a 16-bit cache in the same memory), that every attention path reads the
same int8 values, that a swap carries the int8 rows and their scales to the host pool and back bit for
bit (the same tokens as the same 8-bit run without preemption), and that a cached prefix holds the
bytes the sequence would have written. The default cache stays exact: the suite's other tests run it.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from batching import Engine, EngineConfig, sizing
from batching.kv_cache import KVCache, LayerGeometry, quantize
from batching.sequence import SequenceStatus
from batching.tokenizer import BOS_ID, EOS_ID, byte_level_tokenizer
from tests.batching.conftest import TRITON_PATH, VOCAB, greedy, random_prompts, run_to_completion
from tests.batching.test_swap import host_pools_as_device, kv_of, same

INT8 = dict(kv_cache_dtype="int8")


def test_quantize_bounds_every_row_by_half_its_step():
    torch.manual_seed(0)
    # rows over 40 orders of magnitude (bfloat16 scales keep float32's range), and a row of zeros
    x = (
        torch.randn(3, 41, 64, dtype=torch.float64)
        * torch.logspace(-20, 20, 41, dtype=torch.float64)[:, None]
    )
    x[1, 7] = 0
    q, s = quantize(x)
    assert q.dtype == torch.int8 and s.dtype == torch.bfloat16 and s.shape == x.shape[:-1]
    assert int(q.abs().max()) <= 127
    absmax = x.abs().amax(-1)
    step = s.double()
    assert bool((step >= absmax / 127).all()), "a scale under max|x| / 127 would clip the largest element"
    nonzero = absmax > 0
    assert bool((step[nonzero] <= absmax[nonzero] / 127 * (1 + 2**-7)).all()), "no coarser than needed"
    error = (q.double() * step[..., None] - x).abs()
    assert bool((error <= step[..., None] / 2 * (1 + 1e-12)).all())
    assert int(q[1, 7].abs().max()) == 0


def test_bytes_per_block_count_the_scales():
    layers = [
        LayerGeometry(2, 64, 64),
        None,
        LayerGeometry(2, 64, 64),
    ]  # a layer with no attention keeps none
    int8 = KVCache.bytes_per_block(layers, 16, torch.bfloat16, "int8")
    # per token and layer: 2 KV heads x (64 + 64) bytes, and a K and a V scale per KV head of 2 bytes
    assert int8 == 16 * 2 * (2 * 128 + 2 * 2 * 2)
    assert KVCache.bytes_per_block(layers, 16, torch.bfloat16) / int8 == pytest.approx(1.94, abs=0.01)
    assert KVCache.bytes_per_block(layers, 16, torch.float32) / int8 == pytest.approx(3.88, abs=0.01)
    cache = KVCache(layers, 16, 10, 4, torch.float32, torch.device("cpu"), "int8")
    # every pool the cache allocates is counted: the data pools and the scale pools, +1 scratch block
    assert sum(p.numel() * p.element_size() for p in cache.device_pools) == 11 * int8
    assert sum(p.numel() * p.element_size() for p in cache.host_pools) == 4 * int8
    assert {p.dtype for p in cache.device_pools} == {torch.int8, torch.bfloat16}


def test_kv_cache_dtype_is_validated():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp8")
    assert EngineConfig().kv_cache_dtype == "auto"


@pytest.fixture(scope="module")
def head64_path(tmp_path_factory) -> str:
    """A tiny Llama with head_dim 64 (a real model's head size: the scales' share of a block is 2/64)."""
    cfg = AutoConfig.for_model(
        "llama",
        vocab_size=VOCAB,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=0,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("head64")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    byte_level_tokenizer().save_pretrained(path)
    return str(path)


def test_an_int8_cache_holds_about_twice_the_blocks_in_the_same_memory(head64_path, monkeypatch):
    """Pools sized from memory (num_device_blocks=None): in the same memory an int8 cache gets 1.94x the
    blocks of a bfloat16 one (3.9x a float32 one), and its pools, scales included, stay within it."""
    memory = 64 << 20
    monkeypatch.setattr(sizing, "available_host_memory", lambda: memory)
    budget = memory * sizing.CPU_MEMORY_SHARE * 0.9
    blocks, pool_bytes = {}, {}
    for dtype, kv in [("bfloat16", "auto"), ("float32", "auto"), ("float32", "int8")]:
        engine = Engine(
            EngineConfig(
                model=head64_path,
                dtype=dtype,
                device="cpu",
                kv_cache_dtype=kv,
                max_model_len=512,
                max_num_seqs=1024,  # the memory, not the batch width, bounds the pool
            )
        )
        blocks[dtype, kv] = engine.block_manager.num_device_blocks
        pool_bytes[dtype, kv] = sum(p.numel() * p.element_size() for p in engine.kv_cache.device_pools)
        block_bytes = pool_bytes[dtype, kv] / (blocks[dtype, kv] + 1)  # +1: the scratch block
        assert blocks[dtype, kv] * block_bytes <= budget < (blocks[dtype, kv] + 1) * block_bytes
    assert blocks["float32", "int8"] / blocks["bfloat16", "auto"] == pytest.approx(128 / 66, rel=0.01)
    assert blocks["float32", "int8"] / blocks["float32", "auto"] == pytest.approx(256 / 66, rel=0.01)


def test_the_cache_holds_each_token_quantized(make_engine):
    """What the engine stores is quantize() of the K/V the full-precision cache stores, in the first
    layer (whose K/V do not depend on the cache; the next layers' follow the first's attention): int8
    rows within half a step of them, with their scales."""
    prompt = random_prompts(71, [21])[0]
    engines = {
        kv: make_engine(kv_cache_dtype=kv, block_size=4, num_device_blocks=16) for kv in ("auto", "int8")
    }
    stored = {}
    for kv, engine in engines.items():
        engine.add_request("r", prompt, greedy(2))
        engine.step()  # the prompt's K/V are written; its first token is sampled
        seq = engine.requests["r"]
        stored[kv] = kv_of(engine.kv_cache.device_pools, seq.block_table, len(prompt))
        run_to_completion(engine)
    full = stored["auto"][0][0]  # the first layer's [2, Hkv, T, D]
    data, scales = (t[0] for t in stored["int8"])
    assert data.dtype == torch.int8 and scales.dtype == torch.bfloat16
    q, s = quantize(full)
    assert torch.equal(data, q) and torch.equal(scales, s)
    assert bool(
        ((data.double() * scales.double()[..., None] - full).abs() <= scales.double()[..., None] / 2).all()
    )


def int8_tokens_alone(make_engine, prompts, max_new: int, **config) -> list[list[int]]:
    """The same 8-bit run with room for everything: no preemption."""
    engine = make_engine(**INT8, num_device_blocks=400, num_host_blocks=0, **config)
    outs = engine.generate(prompts, greedy(max_new))
    assert engine.stats()["num_preemptions"] == 0
    return [out.token_ids for out in outs]


def scribble_on_free_blocks(engine) -> None:
    """Free device blocks (that cache no prefix) get garbage in every pool, int8 and scales alike."""
    bm = engine.block_manager
    free = [b for b in bm.free_device if bm.hash_of_block[b] is None]
    if free:
        for pool in engine.kv_cache.device_pools:
            pool.index_fill_(3, torch.tensor(free, dtype=torch.long, device=pool.device), 99)


def test_a_swap_carries_the_int8_rows_and_their_scales_and_resumes_exactly(make_engine):
    """A swapped-out sequence's int8 blocks and scales reach the host pool and come back bit for bit,
    nothing is recomputed, and every sequence ends with the tokens of the same 8-bit run without
    preemption."""
    low, other, urgent = random_prompts(50, [10, 8, 9])
    expected = int8_tokens_alone(make_engine, [low, other, urgent], 12, block_size=3)
    engine = make_engine(
        **INT8,
        block_size=3,
        num_device_blocks=40,
        num_host_blocks=40,
        max_num_seqs=2,
        max_num_batched_tokens=32,
    )
    engine.add_request("low", low, greedy(12), priority=9)
    engine.add_request("other", other, greedy(12), priority=5)
    results = {}

    def step():
        results.update({o.request_id: o for o in engine.step() if o.finished})

    for _ in range(4):
        step()
    seq = engine.requests["low"]
    before_len = seq.num_computed_tokens
    before = kv_of(engine.kv_cache.device_pools, list(seq.block_table), before_len)
    assert {t.dtype for t in before} == {torch.int8, torch.bfloat16}  # data and scales, both compared
    engine.add_request("urgent", urgent, greedy(12), priority=0)
    step()  # no slot free: "low" is swapped out
    assert seq.status == SequenceStatus.SWAPPED
    engine.kv_cache.sync_host()
    assert same(kv_of(host_pools_as_device(engine.kv_cache), seq.host_block_table, before_len), before)
    scribble_on_free_blocks(engine)
    while seq.status == SequenceStatus.SWAPPED:
        step()
        if seq.status == SequenceStatus.SWAPPED:
            scribble_on_free_blocks(engine)
    assert seq.num_computed_tokens == before_len + 1  # swapped in and decoded: nothing recomputed
    assert same(kv_of(engine.kv_cache.device_pools, seq.block_table, before_len), before)
    results.update(run_to_completion(engine))
    assert engine.stats()["num_recomputed_tokens"] == 0
    assert results["low"].num_preemptions == 1
    for name, tokens in zip(["low", "other", "urgent"], expected, strict=True):
        assert results[name].token_ids == tokens, name


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_int8_under_preemption_gives_the_tokens_of_the_run_without(make_engine, mode):
    """Tight pools and urgent arrivals: sequences swapped out and back (or recomputed) end with the same
    tokens as the same 8-bit run with room for all."""
    prompts = random_prompts(12, (1, 2, 5, 17, 40))
    expected = int8_tokens_alone(make_engine, prompts, 8, block_size=4, max_num_batched_tokens=32)
    engine = make_engine(
        **INT8,
        block_size=4,
        num_device_blocks=18,
        num_host_blocks=100 if mode == "swap" else 0,
        preemption_mode=mode,
        max_num_seqs=8,
        max_num_batched_tokens=32,
    )
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(8), priority=9 - i)
    outs = run_to_completion(engine)
    stats = engine.stats()
    assert stats["num_preemptions"] > 0
    assert (stats["num_blocks_swapped_out"] > 0) == (mode == "swap")
    for i, tokens in enumerate(expected):
        assert outs[f"r{i}"].token_ids == tokens, f"r{i}"


def test_a_cached_prefix_holds_the_bytes_the_sequence_would_write(make_engine):
    """Prefix caching with an int8 cache: a scale per token makes a block's bytes depend on its own
    tokens only, so a second prompt sharing a prefix reuses its blocks, which hold what an engine with
    no prefix cache writes, and gets the tokens that engine gets."""
    prefix, tail_a, tail_b = random_prompts(5, [24, 5, 7])
    a, b = prefix + tail_a, prefix + tail_b
    cold = make_engine(**INT8, block_size=4, num_device_blocks=64, enable_prefix_caching=False)
    expected = [out.token_ids for out in cold.generate([a, b], greedy(6))]
    cold.add_request("b", b, greedy(2))
    cold.step()
    written = kv_of(cold.kv_cache.device_pools, cold.requests["b"].block_table, len(prefix))
    run_to_completion(cold)

    engine = make_engine(**INT8, block_size=4, num_device_blocks=64)
    assert engine.generate([a], greedy(6))[0].token_ids == expected[0]
    engine.add_request("b", b, greedy(6))
    engine.step()
    assert engine.stats()["num_prefix_cache_hit_tokens"] == len(prefix)
    assert same(kv_of(engine.kv_cache.device_pools, engine.requests["b"].block_table, len(prefix)), written)
    assert run_to_completion(engine)["b"].token_ids == expected[1]


def logprob_run(path: str, config: dict, prompts) -> tuple[list[list[int]], list[list[float]]]:
    engine = Engine(EngineConfig(model=path, dtype="float64", **INT8, **config))
    outs = engine.generate(prompts, greedy(8, logprobs=0))
    return [o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs]


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])  # gemma2: a sliding window and soft-capping
def test_every_path_attends_over_the_same_int8_values(checkpoint, model_type):
    """int8 rows times their bfloat16 scales are exact in float32 and float64, so the C++ kernels,
    torch and the Triton kernel (CUDA's, here under Triton's interpreter) attend over the same values:
    in float64 the same tokens, and log probabilities equal up to the order of sums. A path that
    ignored a scale, or read the rows as another type, would be far off."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("no triton here: test_attention_paths.py says where it must be")
    path = checkpoint(model_type)
    prompts = random_prompts(11, (1, 5, 17, 40))
    schedule = dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=8)
    runs = {
        "cpu-kernel": logprob_run(
            path, dict(device="cpu", attention_backend="cpu_kernel", **schedule), prompts
        ),
        "cpu-torch": logprob_run(path, dict(device="cpu", attention_backend="torch", **schedule), prompts),
        TRITON_PATH[0]: logprob_run(path, TRITON_PATH[1] | schedule, prompts),
    }
    tokens, logprobs = runs["cpu-torch"]
    for name, (other_tokens, other_logprobs) in runs.items():
        assert other_tokens == tokens, name
        for mine, theirs in zip(other_logprobs, logprobs, strict=True):
            assert mine == pytest.approx(theirs, abs=1e-9), name
