"""The KV pool stores each layer at its own size: Gemma 4's sliding and full layers have different
head sizes, latent attention (DeepSeek-V3) K and V of different sizes. A block's bytes are the real
sum over the layers (what pool sizing divides memory by), and swapping to the host pool and the
prefix cache's host tier copy every pool, so tokens stay identical to generate()."""

from __future__ import annotations

import pytest
import torch

from batching import Engine, EngineConfig, SamplingParams
from batching.kv_cache import KVCache, LayerGeometry
from tests.batching.conftest import run_to_completion
from tools import model_support as support

# the walk's tiny configs, with Gemma 4's full layers at 64 (its default, 512, is not tiny)
MODELS = {
    "gemma4_text": (dict(global_head_dim=64), [LayerGeometry(2, 16, 16), LayerGeometry(2, 64, 64)]),
    "deepseek_v3": ({}, [LayerGeometry(4, 32, 16)] * 2),  # 4 heads, K: 16 nope + 16 rope, V: 16
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def tiny(request, tmp_path_factory):
    """(path, model, expected layer geometries) of a tiny float64 model with per-layer KV geometry."""
    model_type = request.param
    overrides, layers = MODELS[model_type]
    path = tmp_path_factory.mktemp(model_type)
    with support.quiet():
        model = support.build_tiny_model(support.tiny_config(model_type, **overrides))
        model.save_pretrained(path)
    return str(path), model, layers


def engine_for(path: str, **config) -> Engine:
    config = {"device": "cpu", **config}
    with support.quiet():
        return Engine(EngineConfig(model=path, dtype="float64", max_model_len=128, **config))


def test_each_layer_is_stored_at_its_own_size(tiny):
    path, _, layers = tiny
    engine = engine_for(path, block_size=4, num_device_blocks=20, num_host_blocks=6)
    cache = engine.kv_cache
    assert cache.layers == layers
    per_token = sum(g.num_kv_heads * (g.k_dim + g.v_dim) for g in layers)
    block_bytes = 4 * per_token * torch.float64.itemsize
    assert KVCache.bytes_per_block(cache.layers, 4, torch.float64) == block_bytes
    # the device pools hold one block more than the manager hands out: the scratch block (kv_cache.py)
    assert sum(p.numel() * p.element_size() for p in cache.device_pools) == 21 * block_bytes
    assert sum(p.numel() * p.element_size() for p in cache.host_pools) == 6 * block_bytes
    # padded to the largest K or V head of any layer, as before, it took more
    widest = max(max(g.k_dim, g.v_dim) for g in layers)
    assert per_token < sum(2 * g.num_kv_heads * widest for g in layers)
    for layer, g in enumerate(layers):
        assert cache.k[layer].shape == (g.num_kv_heads, 21 * 4, g.k_dim)
        assert cache.v[layer].shape == (g.num_kv_heads, 21 * 4, g.v_dim)


def test_sizing_divides_memory_by_the_real_bytes(tiny, monkeypatch):
    """num_device_blocks=None: the pool gets the memory budget over the real bytes of a block."""
    from batching import sizing

    path, _, layers = tiny
    block_bytes = KVCache.bytes_per_block(layers, 4, torch.float64)
    budget_blocks = 37
    memory = int(budget_blocks * block_bytes / (sizing.CPU_MEMORY_SHARE * 0.9)) + 1
    monkeypatch.setattr(sizing, "available_host_memory", lambda: memory)
    engine = engine_for(path, block_size=4, max_num_seqs=64, memory_utilization=0.9)
    assert engine.block_manager.num_device_blocks == budget_blocks


def test_swap_and_the_host_tier_copy_every_pool_exactly(tiny, engine_path):
    """Preemption swaps sequences out and in, the prefix cache evicts blocks to the host tier and
    copies them back: every layer's K and V travel, so greedy tokens equal generate()'s."""
    path, model, _ = tiny
    engine = engine_for(
        path,
        **engine_path,
        block_size=4,
        num_device_blocks=14,
        num_host_blocks=40,
        max_num_seqs=2,
        max_num_batched_tokens=16,
    )
    prompts = support.prompts(seed=3)[1:]  # 3, 9, 21 and 40 tokens
    long, medium, short, longest = prompts[2], prompts[1], prompts[0], prompts[3]
    expected = dict(
        zip("abcd", support.reference_tokens(model, [long, medium, short, longest], max_new=6), strict=True)
    )
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    engine.add_request("a", long, params, priority=9)
    engine.add_request("b", medium, params, priority=9)
    engine.step()
    engine.step()
    engine.add_request("c", short, params, priority=0)  # no sequence slot free: a or b is swapped out
    outs = run_to_completion(engine)
    stats = engine.stats()
    assert stats["num_blocks_swapped_out"] > 0 and stats["num_recomputed_tokens"] == 0
    engine.add_request("d", longest, params)  # evicts a's cached blocks to the host tier
    outs.update(run_to_completion(engine))
    engine.add_request("a-again", long, params)
    outs.update(run_to_completion(engine))
    stats = engine.stats()
    assert stats["num_prefix_cache_host_hit_tokens"] > 0
    for name in "abcd":
        assert outs[name].token_ids == expected[name], name
    assert outs["a-again"].token_ids == expected["a"]
