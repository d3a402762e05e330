"""Issue 3: KV checkpoints to the host pool. A swapped-out-then-in sequence has bit-identical KV and is
not recomputed; a full (or absent) host pool falls back to recompute and stays exact."""

from __future__ import annotations

import pytest
import torch

from batching import kv_cache as kv_cache_module
from batching.sequence import SequenceStatus
from tests.batching.conftest import greedy, random_prompts, run_to_completion

BLOCK_DIM = getattr(kv_cache_module, "BLOCK_DIM", 2)  # the pools' block axis; the next one is the slot


def host_pools_as_device(kv_cache) -> list[torch.Tensor]:
    """The host pools (block axis first) viewed in the device pools' axis order; after sync_host()."""
    return [pool.movedim(0, BLOCK_DIM) for pool in kv_cache.host_pools]


def kv_of(pools: list[torch.Tensor], block_table: list[int], num_tokens: int) -> list[torch.Tensor]:
    """The K and V of every layer (in every pool) for positions 0..num_tokens-1 of a sequence with this
    block table."""
    out = []
    for pool in pools:
        blocks = pool.index_select(BLOCK_DIM, torch.tensor(block_table, dtype=torch.long, device=pool.device))
        slots = blocks.flatten(BLOCK_DIM, BLOCK_DIM + 1)  # blocks and slots → positions
        out.append(slots.narrow(BLOCK_DIM, 0, num_tokens).clone())
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x.cpu(), y.cpu()) for x, y in zip(a, b))


def scribble_on_free_blocks(engine) -> None:
    """Free device blocks hold garbage; make that explicit so a missing copy cannot pass by luck (free
    blocks that hold cached KV keep it: they are a prefix cache)."""
    bm = engine.block_manager
    free = [b for b in bm.free_device if bm.hash_of_block[b] is None]
    if free:
        for pool in engine.kv_cache.device_pools:
            pool.index_fill_(BLOCK_DIM, torch.tensor(free, dtype=torch.long, device=pool.device), 1234.5)


def test_swapped_out_then_in_kv_is_bit_identical(make_engine, llama_path, reference):
    engine = make_engine(
        block_size=3, num_device_blocks=40, num_host_blocks=40, max_num_seqs=2, max_num_batched_tokens=32
    )
    low, other, urgent = random_prompts(50, [10, 8, 9])
    engine.add_request("low", low, greedy(12), priority=9)
    engine.add_request("other", other, greedy(12), priority=5)
    results = {}

    def step():
        results.update({o.request_id: o for o in engine.step() if o.finished})

    for _ in range(4):
        step()
    seq = engine.requests["low"]
    before_table, before_len = list(seq.block_table), seq.num_computed_tokens
    before = kv_of(engine.kv_cache.device_pools, before_table, before_len)
    stats = engine.stats()

    engine.add_request("urgent", urgent, greedy(12), priority=0)
    step()  # no slot free: "low" is swapped out
    assert seq.status == SequenceStatus.SWAPPED and not seq.block_table
    assert seq.num_computed_tokens == before_len
    assert len(seq.host_block_table) == -(-before_len // 3)
    engine.kv_cache.sync_host()
    assert same(kv_of(host_pools_as_device(engine.kv_cache), seq.host_block_table, before_len), before)
    after_out = engine.stats()
    assert after_out["num_swapped"] == 1
    assert after_out["num_blocks_swapped_out"] - stats["num_blocks_swapped_out"] == len(seq.host_block_table)
    assert after_out["num_free_host_blocks"] == 40 - len(seq.host_block_table)
    assert after_out["host_kv_usage"] == pytest.approx(len(seq.host_block_table) / 40)

    scribble_on_free_blocks(engine)  # the device blocks it left are garbage from now on
    while seq.status == SequenceStatus.SWAPPED:
        step()
        if seq.status == SequenceStatus.SWAPPED:
            scribble_on_free_blocks(engine)
    # the step that swapped it in also decoded one token: nothing was recomputed
    assert seq.status == SequenceStatus.RUNNING
    assert seq.num_computed_tokens == before_len + 1
    assert same(kv_of(engine.kv_cache.device_pools, seq.block_table, before_len), before)
    stats = engine.stats()
    assert stats["num_recomputed_tokens"] == 0
    assert stats["num_blocks_swapped_in"] == stats["num_blocks_swapped_out"] > 0
    assert stats["num_free_host_blocks"] == 40

    results.update(run_to_completion(engine))
    for name, prompt in [("low", low), ("other", other), ("urgent", urgent)]:
        assert results[name].token_ids == reference(llama_path, tuple(prompt), 12)
    assert results["low"].num_preemptions == 1


@pytest.mark.parametrize("host_blocks", [0, 3])
def test_host_pool_exhaustion_falls_back_to_recompute(make_engine, llama_path, reference, host_blocks):
    """Swap mode with no or a tiny host pool: victims that do not fit are recomputed, output stays exact."""
    engine = make_engine(
        block_size=2,
        num_device_blocks=26,
        num_host_blocks=host_blocks,
        max_num_seqs=3,
        max_num_batched_tokens=16,
        preemption_mode="swap",
    )
    prompts = random_prompts(51, [12, 9, 14, 6, 8])
    priorities = [9, 9, 9, 0, 0]
    for i, (p, prio) in enumerate(zip(prompts[:3], priorities[:3], strict=True)):
        engine.add_request(f"r{i}", p, greedy(14), priority=prio)
    for _ in range(3):
        engine.step()
    engine.add_request("r3", prompts[3], greedy(14), priority=0)
    engine.add_request("r4", prompts[4], greedy(14), priority=0)
    results = run_to_completion(engine)
    for i, p in enumerate(prompts):
        assert results[f"r{i}"].token_ids == reference(llama_path, tuple(p), 14), f"r{i} diverged"
    stats = engine.stats()
    assert stats["num_preemptions"] >= 2
    assert stats["num_recomputed_tokens"] > 0
    if host_blocks == 0:
        assert stats["num_blocks_swapped_out"] == 0
    assert (
        stats["num_blocks_swapped_in"]
        == stats["num_blocks_swapped_out"]
        <= stats["num_preemptions"] * host_blocks
    )
