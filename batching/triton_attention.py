"""Paged attention in Triton: the CUDA path. One kernel reads the KV blocks where they lie.

Every row of a step (a decode's one query, a prefill chunk's queries) attends over its sequence's
context through the sequence's block table: no gather of the context into a buffer, no mask tensor,
no Python loop over chunks. A program owns one tile of queries of one sequence for one KV head: the
tile's rows are (query, query head of that KV head) pairs, so grouped-query heads share each K/V
tile they load. It walks the context TILE_N keys at a time, looking each key's block up in the block
table (any block size works), with an exact online softmax (running max and sum, as in
FlashAttention) in float32, or float64 for float64 models. Sliding windows, Llama-4 chunks, Gemma-2
soft-capping and gpt-oss sinks are applied inside; K and V may have different head sizes (latent
attention). An int8 KV cache (kv_cache.py) is read as int8 with a bfloat16 scale per token and KV
head: the rows convert exactly to the query's type (|q| <= 127), a key's scale multiplies its score
column and a value's scale its softmax weight.

Two launches per layer at most: decodes (one query per tile) and prefill chunks (PREFILL_TILE
queries per tile). Their shapes depend only on the number of tiles, and everything else is read from
device tensors, so a decode launch is captured in a CUDA graph as it is (cuda_graphs.py).

Streams: the kernel runs on the caller's (compute) stream and reads only tensors written on that
stream, or on the copy stream before an event the compute stream waits on (kv_cache.py).

On the CPU it runs only under Triton's interpreter (TRITON_INTERPRET=1, set before this module is
imported): the suite checks the very kernel CUDA runs, token for token, on a machine with no GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from batching.attention_metadata import PagedSegments

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# keys per loop iteration: the interpreter runs each iteration in numpy, so wider is faster there
DECODE_TILE_N, PREFILL_TILE_N = (64, 64) if INTERPRETED else (32, 64)


@triton.jit
def _tanh(x):
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


# ints that vary from step to step (the query's strides follow the step's width; block tables are as
# wide as the step's longest context): unspecialized, so one compiled kernel serves every step
@triton.jit(
    do_not_specialize=[
        "stride_qt",
        "stride_qh",
        "stride_qd",
        "stride_ot",
        "stride_oh",
        "stride_bt",
        "window",
        "chunk",
    ]
)
def _paged_attention_kernel(
    Q,
    K,
    V,
    K_SCALES,
    V_SCALES,
    OUT,
    SINKS,
    BLOCK_TABLE,
    SEG_Q_START,
    SEG_Q_LEN,
    SEG_CTX_LEN,
    TILE_SEG,
    TILE_Q_OFF,
    scale,
    softcap,
    window,
    chunk,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ot,
    stride_oh,
    stride_kh,
    stride_kb,
    stride_vh,
    stride_vb,
    stride_ksh,
    stride_ksb,
    stride_vsh,
    stride_vsb,
    stride_bt,
    BLOCK_SIZE: tl.constexpr,
    REP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    DK_P: tl.constexpr,
    DV_P: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CHUNK: tl.constexpr,
    FP64: tl.constexpr,
    INT8_KV: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seg = tl.load(TILE_SEG + tile)
    q_off = tl.load(TILE_Q_OFF + tile)
    q_start = tl.load(SEG_Q_START + seg)
    q_len = tl.load(SEG_Q_LEN + seg)
    ctx_len = tl.load(SEG_CTX_LEN + seg)

    # rows: (query, query head) pairs of this KV head
    m = tl.arange(0, BLOCK_M)
    qi = q_off + m // REP  # the query's index in its segment
    head = kv_head * REP + m % REP
    row_ok = (m < BLOCK_Q * REP) & (qi < q_len)
    q_pos = ctx_len - q_len + qi  # the query's position in its sequence
    dk = tl.arange(0, DK_P)
    dv = tl.arange(0, DV_P)
    q = tl.load(
        Q + (q_start + qi)[:, None] * stride_qt + head[:, None] * stride_qh + dk[None, :] * stride_qd,
        mask=row_ok[:, None] & (dk[None, :] < DK),
        other=0.0,
    )  # [BLOCK_M, DK_P]
    if FP64:
        acc_dtype = tl.float64
    else:
        acc_dtype = tl.float32

    # keys [lo, hi): up to the tile's last query, from the first key its first query may see
    first_pos = ctx_len - q_len + q_off
    hi = ctx_len - q_len + tl.minimum(q_off + BLOCK_Q, q_len)
    lo = first_pos * 0
    if HAS_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0)
    if HAS_CHUNK:
        lo = tl.maximum(lo, first_pos // chunk * chunk)

    m_i = tl.full([BLOCK_M], float("-inf"), acc_dtype)
    l_i = tl.zeros([BLOCK_M], acc_dtype)
    acc = tl.zeros([BLOCK_M, DV_P], acc_dtype)
    for start in range(lo, hi, TILE_N):
        n = start + tl.arange(0, TILE_N)
        n_ok = n < hi
        block = tl.load(BLOCK_TABLE + seg * stride_bt + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        in_block = (n % BLOCK_SIZE).to(tl.int64)
        k = tl.load(
            K + kv_head * stride_kh + block[:, None] * stride_kb + in_block[:, None] * DK + dk[None, :],
            mask=n_ok[:, None] & (dk[None, :] < DK),
            other=0.0,
        )  # [TILE_N, DK_P]
        if INT8_KV:
            k = k.to(Q.dtype.element_ty)  # exact: |k| <= 127
        if FP64:
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        else:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        s = s.to(acc_dtype) * scale  # [BLOCK_M, TILE_N]
        if INT8_KV:
            k_scale = tl.load(
                K_SCALES + kv_head * stride_ksh + block * stride_ksb + in_block, mask=n_ok, other=0.0
            )
            s = s * k_scale.to(acc_dtype)[None, :]
        if HAS_SOFTCAP:
            s = _tanh(s / softcap) * softcap
        allowed = n_ok[None, :] & (n[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            allowed = allowed & (n[None, :] > q_pos[:, None] - window)
        if HAS_CHUNK:
            allowed = allowed & (n[None, :] >= (q_pos // chunk * chunk)[:, None])
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw no key yet
        alpha = tl.exp(m_i - shift)
        p = tl.exp(s - shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            V + kv_head * stride_vh + block[:, None] * stride_vb + in_block[:, None] * DV + dv[None, :],
            mask=n_ok[:, None] & (dv[None, :] < DV),
            other=0.0,
        )  # [TILE_N, DV_P]
        if INT8_KV:
            v = v.to(Q.dtype.element_ty)
            v_scale = tl.load(
                V_SCALES + kv_head * stride_vsh + block * stride_vsb + in_block, mask=n_ok, other=0.0
            )
            p = p * v_scale.to(acc_dtype)[None, :]  # after l_i took p: the scale weighs the value only
        if FP64:
            pv = tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee").to(acc_dtype)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if HAS_SINKS:  # one extra logit per head that takes probability mass and has no value
        sink = tl.load(SINKS + head, mask=row_ok, other=float("-inf")).to(acc_dtype)
        m_new = tl.maximum(m_i, sink)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - shift)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.exp(sink - shift)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a padded row (no context) stays 0
    tl.store(
        OUT + (q_start + qi)[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :],
        out.to(OUT.dtype.element_ty),
        mask=row_ok[:, None] & (dv[None, :] < DV),
    )


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def attend(
    q: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    out: torch.Tensor,
    segments: PagedSegments,
    block_size: int,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
    sliding_window: int | None,
    chunk: int | None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    """out[t] = attention of q[t] over its sequence's cached context. q: [T, H, Dk] (any strides);
    k_blocks: [Hkv, num_blocks, block_size * Dk]; v_blocks: [.., block_size * Dv]; out: [T, H, Dv].
    int8 blocks come with k_scales and v_scales: [Hkv, num_blocks, block_size] (bfloat16, last axis contiguous)."""
    num_heads, dk = q.shape[1], q.shape[2]
    num_kv_heads, dv = k_blocks.shape[0], v_blocks.shape[2] // block_size
    rep = num_heads // num_kv_heads
    int8_kv = k_blocks.dtype == torch.int8
    # the scales (int8 caches), else q as a pointer never read, with strides 0 (q's vary by step: no respecialization)
    ks, ks_strides = (k_scales, k_scales.stride()[:2]) if k_scales is not None else (q, (0, 0))
    vs, vs_strides = (v_scales, v_scales.stride()[:2]) if v_scales is not None else (q, (0, 0))
    for launch in (segments.decode, segments.prefill):
        if launch is None or launch.num_tiles == 0:
            continue
        block_m = max(16, _pow2(launch.block_q * rep))
        _paged_attention_kernel[(launch.num_tiles, num_kv_heads)](
            q,
            k_blocks,
            v_blocks,
            ks,
            vs,
            out,
            sinks if sinks is not None else q,  # never read without HAS_SINKS
            segments.block_table,
            segments.q_start,
            segments.q_len,
            segments.ctx_len,
            launch.tile_seg,
            launch.tile_q_off,
            float(scale),
            float(softcap or 1.0),
            int(sliding_window or 0),
            int(chunk or 0),
            q.stride(0),
            q.stride(1),
            q.stride(2),
            out.stride(0),
            out.stride(1),
            k_blocks.stride(0),
            k_blocks.stride(1),
            v_blocks.stride(0),
            v_blocks.stride(1),
            *ks_strides,
            *vs_strides,
            segments.block_table.stride(0),
            BLOCK_SIZE=block_size,
            REP=rep,
            BLOCK_Q=launch.block_q,
            BLOCK_M=block_m,
            TILE_N=DECODE_TILE_N if launch.block_q == 1 else PREFILL_TILE_N,
            DK=dk,
            DV=dv,
            DK_P=max(16, _pow2(dk)),
            DV_P=max(16, _pow2(dv)),
            HAS_SOFTCAP=softcap is not None,
            HAS_SINKS=sinks is not None,
            HAS_WINDOW=sliding_window is not None,
            HAS_CHUNK=chunk is not None,
            FP64=q.dtype == torch.float64,
            INT8_KV=int8_kv,
        )
