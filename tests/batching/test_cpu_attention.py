"""The CPU paged-attention kernels (decode and prefill) against a plain per-sequence attention, and
their build and fallback."""

from __future__ import annotations

import logging

import pytest
import torch

from batching import Engine, EngineConfig, SamplingParams, cpu_attention


def reference_decode(q, k_pool, v_pool, tables, lens, scale, softcap=None, sinks=None, window=None):
    """q: [n, H, D]; pools: [Hkv, blocks, bs, D]; tables: [n, width]. One sequence and head at a time."""
    n, num_heads, _ = q.shape
    rep = num_heads // k_pool.shape[0]
    out = torch.empty_like(q)
    for i in range(n):
        length = int(lens[i])
        for h in range(num_heads):
            g = h // rep
            k = k_pool[g, tables[i]].flatten(0, 1)[:length]  # [L, D]
            v = v_pool[g, tables[i]].flatten(0, 1)[:length]
            scores = k @ q[i, h] * scale
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            if window is not None:
                scores[: max(0, length - window)] = float("-inf")
            if sinks is not None:
                scores = torch.cat([scores, sinks[h].reshape(1).to(scores.dtype)])
            probs = torch.softmax(scores, dim=0)[:length]
            out[i, h] = probs @ v
    return out


def random_case(dtype, block_size, num_heads, num_kv_heads, lens, head_dim=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-length // block_size) for length in lens)
    num_blocks = len(lens) * width + 3
    k_pool = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen, dtype=dtype)
    v_pool = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen, dtype=dtype)
    # scattered, non-overlapping blocks per sequence; padding entries point at block 0
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lens), width, dtype=torch.long)
    used = 0
    for i, length in enumerate(lens):
        need = -(-length // block_size)
        tables[i, :need] = order[used : used + need]
        used += need
    # q as the model hands it over: a [T, H, D] view of a [H, T, D] tensor
    q = torch.randn(num_heads, len(lens), head_dim, generator=gen, dtype=dtype).transpose(0, 1)
    return q, k_pool, v_pool, tables, torch.tensor(lens, dtype=torch.long)


@pytest.fixture(scope="module")
def kernel():
    loaded = cpu_attention.load()
    assert loaded is not None, "the kernel must build here (a C++ compiler is on this machine)"
    return loaded


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("variant", [{}, {"softcap": 5.0}, {"window": 7}, {"sinks": True}])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("head_dim", [32, 64, 128])  # 64 and 128 have paths of their own
def test_kernel_matches_plain_attention(
    kernel, dtype, tol, block_size, num_heads, num_kv_heads, variant, threads, head_dim
):
    lens = [1, 2, 16, 17, 33, 100, 5]
    q, k_pool, v_pool, tables, context_lens = random_case(
        dtype, block_size, num_heads, num_kv_heads, lens, head_dim
    )
    sinks = torch.randn(num_heads, dtype=torch.float32) if variant.get("sinks") else None
    softcap, window = variant.get("softcap"), variant.get("window")
    out = torch.full_like(q, float("nan"))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kernel.decode(
            q,
            k_pool.flatten(2),
            v_pool.flatten(2),
            tables.flatten(),
            tables.shape[1],
            context_lens,
            out,
            0.3,
            softcap,
            sinks,
            window,
        )
    finally:
        torch.set_num_threads(before)
    # bfloat16: the reference computes in float32 on the same (bfloat16) values, rounded once at the end,
    # as the kernel does: within a unit in the last place of bfloat16 (2^-8 relative)
    wide = (lambda t: t.float()) if dtype == torch.bfloat16 else (lambda t: t)
    expected = reference_decode(
        wide(q), wide(k_pool), wide(v_pool), tables, context_lens, 0.3, softcap, sinks, window
    ).to(dtype)
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


def reference_prefill(q, k_pool, v_pool, tables, starts, ctx_lens, scale, softcap, sinks, window):
    """Chunk i's queries (rows starts[i]..starts[i+1]) at the last positions of its ctx_lens[i] tokens."""
    out = torch.full_like(q, float("nan"))
    rep = q.shape[1] // k_pool.shape[0]
    for i, ctx in enumerate(ctx_lens.tolist()):
        rows = range(int(starts[i]), int(starts[i + 1]))
        for j, row in enumerate(rows):
            pos = ctx - len(rows) + j
            for h in range(q.shape[1]):
                k = k_pool[h // rep, tables[i]].flatten(0, 1)[: pos + 1]
                v = v_pool[h // rep, tables[i]].flatten(0, 1)[: pos + 1]
                scores = k @ q[row, h] * scale
                if softcap is not None:
                    scores = torch.tanh(scores / softcap) * softcap
                if window is not None:
                    scores[: max(0, pos + 1 - window)] = float("-inf")
                if sinks is not None:
                    scores = torch.cat([scores, sinks[h].reshape(1).to(scores.dtype)])
                out[row, h] = torch.softmax(scores, dim=0)[: pos + 1] @ v
    return out


# (queries, context) per chunk: whole prompts, chunks deep in a prompt, tiles of 32 rows and their edges
PREFILL_CHUNKS = [(5, 5), (40, 40), (17, 100), (70, 300), (1, 9), (33, 33)]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("block_size", [1, 24])  # 16, the default, runs in the engine tests
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("variant", [{}, {"softcap": 5.0}, {"window": 7}, {"sinks": True}])
@pytest.mark.parametrize("threads", [2])  # one thread runs the same tiles in turn
@pytest.mark.parametrize("head_dim", [24, 64, 128])  # 64 and 128 have paths of their own
def test_prefill_kernel_matches_plain_attention(
    kernel, dtype, tol, block_size, num_heads, num_kv_heads, variant, threads, head_dim
):
    ctx_lens = [ctx for _, ctx in PREFILL_CHUNKS]
    _, k_pool, v_pool, tables, _ = random_case(dtype, block_size, num_heads, num_kv_heads, ctx_lens, head_dim)
    # the packed batch: 3 decode rows first (the kernel must leave them alone), then the chunks' rows
    sizes = [n for n, _ in PREFILL_CHUNKS]
    starts = torch.tensor([3] + sizes, dtype=torch.long).cumsum(0)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(num_heads, int(starts[-1]), head_dim, generator=gen, dtype=dtype).transpose(0, 1)
    sinks = torch.randn(num_heads, dtype=torch.float32) if variant.get("sinks") else None
    softcap, window = variant.get("softcap"), variant.get("window")
    chunks = cpu_attention.PrefillTables(
        starts, torch.tensor(ctx_lens, dtype=torch.long), tables.flatten(), tables.shape[1]
    )
    out = torch.full_like(q, float("nan"))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        kernel.prefill(q, k_pool.flatten(2), v_pool.flatten(2), chunks, out, 0.3, softcap, sinks, window)
    finally:
        torch.set_num_threads(before)
    assert out[:3].isnan().all(), "rows outside the chunks were written"
    wide = (lambda t: t.float()) if dtype == torch.bfloat16 else (lambda t: t)
    expected = reference_prefill(
        wide(q), wide(k_pool), wide(v_pool), tables, starts, chunks.ctx_lens, 0.3, softcap, sinks, window
    ).to(dtype)
    torch.testing.assert_close(out[3:], expected[3:], rtol=tol, atol=tol)


def test_kernel_bfloat16_rounds_once_to_nearest(kernel):
    """One key: the output is its value exactly, whatever the query; rounding happens on the way out only."""
    q, k_pool, v_pool, tables, lens = random_case(torch.bfloat16, 16, 4, 2, [1])
    out = torch.empty_like(q)
    kernel.decode(
        q, k_pool.flatten(2), v_pool.flatten(2), tables.flatten(), 1, lens, out, 0.3, None, None, None
    )
    expected = v_pool[:, tables[0, 0], 0].repeat_interleave(2, dim=0)  # [H, D]
    assert torch.equal(out[0], expected)


def test_kernel_takes_float_types_on_cpu_only(kernel):
    assert kernel.supports(torch.float32, torch.device("cpu"))
    assert kernel.supports(torch.float64, torch.device("cpu"))
    assert kernel.supports(torch.bfloat16, torch.device("cpu"))
    assert not kernel.supports(torch.float16, torch.device("cpu"))
    assert not kernel.supports(torch.float32, torch.device("cuda"))


def test_the_engine_attends_with_the_kernels_on_cpu(checkpoint, monkeypatch):
    """On by default, and really called in a step: the torch paths are not silently taken."""
    engine = Engine(EngineConfig(model=checkpoint("llama"), dtype="float64", device="cpu"))
    assert engine.runner.attention_kernel is not None
    calls = []
    for name in ("decode", "prefill"):
        real = getattr(cpu_attention.PagedAttentionKernel, name)
        monkeypatch.setattr(
            cpu_attention.PagedAttentionKernel,
            name,
            lambda self, *a, _name=name, _real=real, **k: calls.append(_name) or _real(self, *a, **k),
        )
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert "prefill" in calls, "the prompt was not attended by the prefill kernel"
    assert "decode" in calls, "a decode step did not go through the kernel"
    off = Engine(
        EngineConfig(model=checkpoint("llama"), dtype="float64", device="cpu", cpu_attention_kernel=False)
    )
    assert off.runner.attention_kernel is None


def test_kernel_path_and_torch_path_give_the_same_tokens(checkpoint, reference):
    """cpu_attention_kernel on and off (the torch fallback) both stay exact: Gemma 2's window and
    soft-capping."""
    from tests.batching.test_exactness import assert_matches_reference

    for on in (True, False):
        engine = assert_matches_reference(
            checkpoint("gemma2"),
            reference,
            dict(device="cpu"),
            max_num_batched_tokens=64,
            block_size=16,
            max_num_seqs=64,
            cpu_attention_kernel=on,
        )
        assert engine.attention_backend == ("cpu_kernel" if on else "torch")


def test_a_failed_build_falls_back_to_torch_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CXX", "/bin/false")
    monkeypatch.setenv("GENQ_KERNEL_CACHE", str(tmp_path))
    cpu_attention.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="batching.cpu_attention"):
            assert cpu_attention.load() is None
        assert "unavailable" in caplog.text and "torch path" in caplog.text
        assert not list(tmp_path.glob("*.so"))
    finally:
        cpu_attention.load.cache_clear()


def test_the_build_is_cached_by_source(tmp_path, monkeypatch):
    monkeypatch.setenv("GENQ_KERNEL_CACHE", str(tmp_path))
    cpu_attention.load.cache_clear()
    try:
        first = cpu_attention._build()
        mtime = first.stat().st_mtime_ns
        assert cpu_attention._build() == first and first.stat().st_mtime_ns == mtime  # not rebuilt
        assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temp files left
    finally:
        cpu_attention.load.cache_clear()


def cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as info:
        return next((set(line.split(":")[1].split()) for line in info if line.startswith("flags")), set())


def test_bfloat16_prefill_runs_on_amx_tiles_where_the_cpu_has_them(kernel):
    assert kernel.prefill_tiles() == ("amx_bf16" in cpu_flags())
    assert kernel.prefill_tiles(False) is False
    assert kernel.prefill_tiles(True) == ("amx_bf16" in cpu_flags())


@pytest.mark.parametrize("tiles", [True, False])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (6, 1)])  # 16 rows a tile: GQA leaves a remainder
@pytest.mark.parametrize("variant", [{}, {"window": 37}, {"sinks": True}])
def test_bfloat16_prefill_on_tiles_and_on_pair_products(
    kernel, tiles, head_dim, num_heads, num_kv_heads, variant
):
    """bfloat16 prefill with its products on AMX tiles (where the CPU has them) and on AVX-512 pair products:
    each within a bfloat16 ulp of the reference, over chunks whose keys end at any offset of a tile's 32."""
    chunks_at = [(5, 5), (130, 130), (33, 300), (64, 64), (1, 47), (77, 200)]
    ctx_lens = [ctx for _, ctx in chunks_at]
    _, k_pool, v_pool, tables, _ = random_case(
        torch.bfloat16, 16, num_heads, num_kv_heads, ctx_lens, head_dim
    )
    starts = torch.tensor([0] + [n for n, _ in chunks_at], dtype=torch.long).cumsum(0)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(int(starts[-1]), num_heads, head_dim, generator=gen).to(torch.bfloat16)
    sinks = torch.randn(num_heads, dtype=torch.float32) if variant.get("sinks") else None
    window = variant.get("window")
    chunks = cpu_attention.PrefillTables(
        starts, torch.tensor(ctx_lens, dtype=torch.long), tables.flatten(), tables.shape[1]
    )
    out = torch.full_like(q, float("nan"))
    kernel.prefill_tiles(tiles)
    try:
        kernel.prefill(q, k_pool.flatten(2), v_pool.flatten(2), chunks, out, 0.3, None, sinks, window)
    finally:
        kernel.prefill_tiles(True)
    expected = reference_prefill(
        q.float(), k_pool.float(), v_pool.float(), tables, starts, chunks.ctx_lens, 0.3, None, sinks, window
    ).to(torch.bfloat16)
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(
    "head_dim", [32, 64]
)  # 64: the AVX-512 paths where the CPU has them; 32: the plain loops
def test_bfloat16_weights_are_rounded_before_they_weigh_the_values(kernel, head_dim):
    """As torch's CPU SDPA computes bfloat16 attention: exp(s - max) rounded to bfloat16 before p . v, summed
    unrounded for the denominator. Against that formula the kernels agree in nearly every element (the order of
    sums aside); with the weights unrounded about 60-70% agree."""

    def expected(q, k, v, causal):  # q: [T, D]; k, v: [L, D]; float32 of bfloat16 values
        s = q @ k.T * 0.3
        if causal:
            s = s.masked_fill(
                torch.ones_like(s, dtype=torch.bool).triu(k.shape[0] - q.shape[0] + 1), float("-inf")
            )
        p = (s - s.amax(-1, keepdim=True)).exp()
        return (p.to(torch.bfloat16).float() @ v / p.sum(-1, keepdim=True)).to(torch.bfloat16)

    lens = [300] * 8
    q, k_pool, v_pool, tables, context_lens = random_case(torch.bfloat16, 16, 4, 2, lens, head_dim)
    out = torch.empty_like(q)
    kernel.decode(q, k_pool.flatten(2), v_pool.flatten(2), tables.flatten(), tables.shape[1], context_lens, out,
                  0.3, None, None, None)  # fmt: skip
    want = torch.empty_like(q)
    for i in range(len(lens)):
        for h in range(4):
            k = k_pool[h // 2, tables[i]].flatten(0, 1)[:300].float()
            v = v_pool[h // 2, tables[i]].flatten(0, 1)[:300].float()
            want[i, h] = expected(q[i, h].float()[None], k, v, causal=False)[0]
    assert (out == want).float().mean() > 0.95

    # prefill: one chunk of 100 queries ending at position 299
    gen = torch.Generator().manual_seed(2)
    qp = torch.randn(100, 4, head_dim, generator=gen).to(torch.bfloat16)
    chunks = cpu_attention.PrefillTables(
        torch.tensor([0, 100]), torch.tensor([300]), tables[0].clone(), tables.shape[1]
    )
    out = torch.empty_like(qp)
    kernel.prefill(qp, k_pool.flatten(2), v_pool.flatten(2), chunks, out, 0.3, None, None, None)
    want = torch.empty_like(qp)
    for h in range(4):
        k = k_pool[h // 2, tables[0]].flatten(0, 1)[:300].float()
        v = v_pool[h // 2, tables[0]].flatten(0, 1)[:300].float()
        want[:, h] = expected(qp[:, h].float(), k, v, causal=True)
    assert (out == want).float().mean() > 0.95


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.int8])
def test_write_rows_stores_each_row_in_its_slot_as_index_copy_does(kernel, dtype):
    """The pool's row write (the KV cache's on the CPU): a step's keys, a strided view of the fused q/k/v
    projection as the layer hands them over, land in their slots; every other slot keeps what it held."""
    gen = torch.Generator().manual_seed(3)
    heads, slots, dim, rows = 3, 64, 40, 7
    pool = (torch.randn(heads, slots, dim, generator=gen) * 50).to(dtype)
    # the fused q/k/v projection's output, [T, (H + 2 Hkv) D]
    projection = (torch.randn(rows, (4 + 2 * heads) * dim, generator=gen) * 50).to(dtype)
    keys = projection[:, 4 * dim : (4 + heads) * dim].view(rows, heads, dim).transpose(0, 1)  # [Hkv, T, D]
    slot_mapping = torch.randperm(slots, generator=gen)[:rows].contiguous()
    expected = pool.clone().index_copy_(1, slot_mapping, keys)
    kernel.write_rows(pool, slot_mapping, keys)
    assert torch.equal(pool, expected)
