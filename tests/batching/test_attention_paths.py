"""The path CUDA runs, token for token: the Triton paged-attention kernel (and, on CUDA, the graphs of
decode steps) against transformers' generate() in float64.

On a machine without CUDA the kernel runs under Triton's interpreter, the very kernel CUDA compiles,
one program at a time in numpy: slow, so a chosen few models and schedules (the engine paths of
conftest.ENGINE_PATHS run every parity test on the C++ kernels and on torch). On a CUDA machine
the same tests run on the device, and the parity tests run there too (ENGINE_PATHS: cuda-triton).
"""

from __future__ import annotations

import importlib.util
import platform

import pytest
import torch

from batching import Engine, EngineConfig, SamplingParams
from batching.cuda_graphs import MAX_CHUNKS, StepGraphs, decode_shape, mixed_shape, sampled_rows
from batching.model_runner import MetadataPacker, StepRows
from batching.scheduler import SchedulerOutput
from tests.batching.conftest import TRITON_PATH, greedy, random_prompts, run_to_completion
from tools import model_support as support

# pyproject's dev extra installs triton here (its CPU interpreter runs these tests): where it does, a missing
# triton fails them instead of skipping them
DEV_EXTRA_HAS_TRITON = platform.system() == "Linux" and platform.machine() == "x86_64"
pytestmark = pytest.mark.skipif(
    not DEV_EXTRA_HAS_TRITON and importlib.util.find_spec("triton") is None,
    reason="no triton wheel for this platform (the dev extra installs it on Linux x86_64 only)",
)


def test_triton_is_installed_wherever_the_dev_extra_installs_it():
    assert importlib.util.find_spec("triton") is not None, (
        "triton is missing, yet the dev extra requires it here: make install (pip install -e '.[dev]')"
    )


PATH_NAME, PATH = TRITON_PATH
PROMPT_LENGTHS = (1, 2, 5, 17, 40)
MAX_NEW = 8


def engine_on_triton(path: str, **config) -> Engine:
    engine = Engine(EngineConfig(model=path, dtype="float64", **(PATH | config)))
    assert engine.attention_backend == "triton"
    return engine


@pytest.mark.parametrize(
    "model_type,schedule",
    [
        ("llama", dict(max_num_batched_tokens=7, block_size=1, max_num_seqs=3)),
        ("llama", dict(max_num_batched_tokens=64, block_size=16, max_num_seqs=64)),
        ("qwen2", dict(max_num_batched_tokens=16, block_size=4, max_num_seqs=8)),
        ("gpt2", dict(max_num_batched_tokens=16, block_size=16, max_num_seqs=3)),
        ("mistral", dict(max_num_batched_tokens=9, block_size=3, max_num_seqs=8)),  # a 12-token window
        ("gemma2", dict(max_num_batched_tokens=16, block_size=4, max_num_seqs=8)),  # window + soft-capping
    ],
    ids=lambda value: value if isinstance(value, str) else "-".join(map(str, value.values())),
)
def test_triton_path_matches_generate(checkpoint, reference, model_type, schedule):
    path = checkpoint(model_type)
    engine = engine_on_triton(path, **schedule)
    prompts = random_prompts(11, PROMPT_LENGTHS)
    outs = engine.generate(prompts, greedy(MAX_NEW))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference(path, tuple(prompt), MAX_NEW), f"{len(prompt)}-token prompt"


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_triton_path_exact_under_preemption(checkpoint, reference, mode):
    """Tight pools and urgent arrivals: sequences are swapped out and back (or recomputed)."""
    path = checkpoint("llama")
    engine = engine_on_triton(
        path,
        block_size=4,
        num_device_blocks=18,
        num_host_blocks=100 if mode == "swap" else 0,
        preemption_mode=mode,
        max_num_seqs=8,
        max_num_batched_tokens=32,
    )
    prompts = random_prompts(12, PROMPT_LENGTHS)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(MAX_NEW), priority=9 - i)
    outs = run_to_completion(engine)
    stats = engine.stats()
    assert stats["num_preemptions"] > 0
    assert (stats["num_blocks_swapped_out"] > 0) == (mode == "swap")
    for i, prompt in enumerate(prompts):
        assert outs[f"r{i}"].token_ids == reference(path, tuple(prompt), MAX_NEW), f"r{i}"


# attention sinks (gpt-oss), Llama-4's chunked attention, K and V of different head sizes (latent attention)
@pytest.mark.parametrize("model_type", ["gpt_oss", "llama4_text", "deepseek_v3"])
def test_triton_path_runs_the_attention_variants(model_type, tmp_path):
    result = support.check_model_type(model_type, str(tmp_path), engine_options=PATH)
    assert result.status == "identical", result.reason


def test_padded_rows_of_a_graph_change_nothing(checkpoint):
    """A CUDA graph runs a decode step padded to its bucket: the padded rows write only the scratch
    block and attend over nothing, so the real rows' logits and every owned KV block are as without
    padding (checked here without a graph, so the CPU checks it too). A padded row that attended or
    wrote like a real one (a slot of block 0, a context of one token) fails both checks."""
    engine = engine_on_triton(checkpoint("llama"), block_size=4, cuda_graphs=False)
    for i, prompt in enumerate(random_prompts(13, (3, 9, 21))):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    while not all(seq.is_decoding for seq in engine.requests.values()):
        engine.step()
    runner, cache = engine.runner, engine.kv_cache
    running = list(engine.requests.values())
    sched = SchedulerOutput(seqs=running, num_scheduled_tokens=[1] * len(running))
    rows = runner.step_rows(sched)
    with torch.inference_mode():
        plain = runner.forward(runner.prepare(sched, rows)).clone()
        owned = [pool.narrow(3, 0, cache.num_device_blocks).clone() for pool in cache.device_pools]
        host, spans, width, _ = runner.packer.layout(rows, cache.block_size, decode_shape(8), width=32)
        batch = MetadataPacker.views(
            runner.packer.send(host), spans, width, 0, rows, cache, runner.mask_patterns
        )
        padded = runner.forward(batch)
    assert padded.shape[0] == 8
    # equal up to rounding: the model's matmuls may block 8 rows differently from 3
    torch.testing.assert_close(padded[: len(running)], plain, rtol=1e-12, atol=1e-12)
    for before, pool in zip(owned, cache.device_pools):
        torch.testing.assert_close(pool.narrow(3, 0, cache.num_device_blocks), before, rtol=1e-12, atol=1e-12)
    slots, contexts = (host[spans[name][0] : sum(spans[name])] for name in ("slot_mapping", "ctx_len"))
    assert list(slots[len(running) :]) == [cache.scratch_slot] * (8 - len(running))
    assert list(contexts[len(running) :]) == [0] * (8 - len(running))


def test_padded_rows_of_a_mixed_graph_change_nothing(checkpoint):
    """A step of decodes and prefill chunks padded to a mixed graph's shape (rows, segments, both launches'
    tiles): the real rows' logits and every owned KV block are as without padding, padded rows write only
    the scratch slot, padded segments have no rows and no context, and padded tiles point at the padding
    segment. A padded tile that pointed at a real segment, or a padded segment with rows, fails."""
    engine = engine_on_triton(checkpoint("llama"), block_size=4, cuda_graphs=False, max_num_seqs=8)
    for i, prompt in enumerate(random_prompts(14, (3, 9))):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    while not all(seq.is_decoding for seq in engine.requests.values()):
        engine.step()
    engine.add_request("new", random_prompts(15, (37,))[0], SamplingParams(max_tokens=4, temperature=0))
    sched = engine.scheduler.schedule()  # 2 decodes + a chunk of the new prompt
    assert sched.num_scheduled_tokens == [1, 1, 37]
    runner, cache = engine.runner, engine.kv_cache
    rows = runner.step_rows(sched)
    shape = mixed_shape(64, 8)
    with torch.inference_mode():
        plain = runner.forward(runner.prepare(sched, rows)).clone()
        owned = [pool.narrow(3, 0, cache.num_device_blocks).clone() for pool in cache.device_pools]
        host, spans, width, tiles = runner.packer.layout(rows, cache.block_size, shape, width=64)
        batch = MetadataPacker.views(
            runner.packer.send(host),
            spans,
            width,
            tiles,
            rows,
            cache,
            runner.mask_patterns,
            uncovered_rows=True,
        )
        padded = runner.forward(batch)
    assert tiles == shape.prefill_tiles == 4 + MAX_CHUNKS and padded.shape[0] == shape.segments
    torch.testing.assert_close(padded[: len(rows.logits_rows)], plain, rtol=1e-12, atol=1e-12)
    for before, pool in zip(owned, cache.device_pools):
        torch.testing.assert_close(pool.narrow(3, 0, cache.num_device_blocks), before, rtol=1e-12, atol=1e-12)
    field = {name: list(host[spans[name][0] : sum(spans[name])]) for name in spans}
    assert field["slot_mapping"][39:] == [cache.scratch_slot] * (64 - 39)
    assert field["q_len"][3:] == field["ctx_len"][3:] == [0] * (shape.segments - 3)
    assert field["decode_seg"][2:] == [shape.segments - 1] * (shape.decode_tiles - 2)
    assert field["prefill_seg"][:3] == [2, 2, 2] and field["prefill_seg"][3:] == [shape.segments - 1] * 5


def test_steps_padded_to_graphs_stay_exact(checkpoint, reference):
    """Every step the graphs take (decode and mixed, here padded and run eagerly: capture is CUDA's) gives
    generate()'s tokens, with prompts arriving while others decode."""
    path = checkpoint("llama")
    engine = engine_on_triton(
        path, block_size=4, max_num_seqs=6, max_num_batched_tokens=40, cuda_graphs=False
    )
    graphs = StepGraphs(engine.runner, 6, 64, 40, capture=False)
    assert graphs.capture() and graphs.token_sizes == [32, 40]
    engine.runner.graphs = graphs
    prompts = random_prompts(16, (5, 23, 2, 61, 11, 30, 8))
    for i, prompt in enumerate(prompts[:3]):
        engine.add_request(f"r{i}", prompt, greedy(MAX_NEW))
    outs = {}
    for step in range(200):
        if 2 <= step < 2 + len(prompts) - 3:
            i = step + 1
            engine.add_request(f"r{i}", prompts[i], greedy(MAX_NEW))
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    stats = engine.stats()
    assert stats["num_mixed_graph_steps"] > 3 and stats["num_graph_steps"] > stats["num_mixed_graph_steps"]
    for i, prompt in enumerate(prompts):
        assert outs[f"r{i}"].token_ids == reference(path, tuple(prompt), MAX_NEW), f"r{i}"


@pytest.mark.parametrize("wanted", [[0, 1, 2], [1], []])  # a prompt token fed alone samples nothing
def test_a_replay_hands_the_sampler_the_rows_it_samples(wanted):
    logits = torch.arange(8 * 5, dtype=torch.float64).view(8, 5)  # a graph of 8 rows, 3 of them real
    rows = StepRows([7, 8, 9], [4, 5, 6], [0, 1, 2], wanted, [], [None] * 3, [1, 1, 1], 3)
    assert torch.equal(sampled_rows(logits, rows), logits[wanted])


def test_persistent_block_tables_follow_every_change():
    """The Triton path's block tables are rows of one array written as the tables change: growing lists,
    lists replaced (swap-in, preemption, a cached prefix), sequences leaving and more arriving than rows."""
    import random

    from batching.model_runner import BlockTables
    from batching.sequence import Sequence

    rng = random.Random(5)
    tables = BlockTables()
    live = [Sequence(f"s{i}", [1], SamplingParams(), 5, 0) for i in range(20)]
    for step in range(300):
        for seq in live:
            if rng.random() < 0.2:
                seq.block_table.append(rng.randrange(10_000))
            if rng.random() < 0.02:
                seq.block_table = [rng.randrange(10_000) for _ in range(rng.randrange(8))]
        if rng.random() < 0.3:  # one leaves, a new one arrives
            live.pop(rng.randrange(len(live)))
            live.append(Sequence(f"n{step}", [1], SamplingParams(), 5, 0))
        stepping = rng.sample(live, rng.randrange(1, len(live)))
        width = max(len(s.block_table) for s in stepping) + rng.randrange(3)
        got = tables.gather(stepping, width)
        for seq, row in zip(stepping, got):
            assert list(row[: len(seq.block_table)]) == seq.block_table, (step, seq)
    assert tables.table.shape[0] <= 128, "rows of sequences that left are reused"
