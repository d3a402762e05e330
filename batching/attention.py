"""Paged attention, registered with transformers' AttentionInterface.

The model's own attention modules compute q/k/v (and RoPE) and call `paged_attention`. It writes the
step's new K/V into cache slots, then attends each sequence's queries over its cached context.
Per-step metadata arrives explicitly through the forward's kwargs (`genq_attn=`), never as a global;
models that do not pass those kwargs down (falcon, gptj, gpt_neo: attention_classes.py) read it from
`step_context`, a context variable the runner sets around each forward.
Three paths attend (attention_metadata.py says what each is given):

- CUDA: one Triton kernel reads the blocks in place for every row of the step (triton_attention.py);
- the CPU: C++ kernels read the blocks in place (cpu_attention.py);
- torch, the fallback on either device: decodes in a few batched calls grouped by context length (so
  little padding is gathered), and all prefill chunks in one padded call.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar, Token

import torch
import torch.nn.functional as F

from batching.attention_metadata import AttentionMetadata

ATTENTION_NAME = "genq_paged"


_step: ContextVar[object | None] = ContextVar("genq_step", default=None)


@contextlib.contextmanager
def step_context(meta):
    """The step's metadata for attention layers that receive no forward kwargs, during one forward."""
    token = _step.set(meta)
    try:
        yield
    finally:
        _step.reset(token)


def set_step(meta) -> Token:
    """`step_context`'s entry without its context manager (a generator's, ~1.5 us a step): reset with `reset_step`."""
    return _step.set(meta)


def reset_step(token: Token) -> None:
    _step.reset(token)


def current_step():
    return _step.get()


def paged_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    dropout=0.0,
    sliding_window=None,
    softcap=None,
    s_aux=None,
    genq_attn: AttentionMetadata | None = None,
    **kwargs,
):
    """query: [1, H, T, Dk]; key: [1, Hkv, T, Dk]; value: [1, Hkv, T, Dv]. Returns ([1, T, H, Dv], None)."""
    meta = genq_attn
    if meta is None:
        raise RuntimeError(
            f"{type(module).__name__} called genq's paged attention without the engine's step metadata "
            "(genq_attn=...): it does not pass the forward's keyword arguments on"
        )
    layer, cache = module.layer_idx, meta.kv_cache
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # the cache holds each layer at its own geometry (kv_cache.py): its KV heads, K and V head sizes;
    # an int8 cache quantizes here and each path below dequantizes as it reads
    cache.write(layer, meta.slot_mapping, key[0], value[0])  # [Hkv, T, Dk], [Hkv, T, Dv]
    k_scales, v_scales = cache.k_scale_blocks[layer], cache.v_scale_blocks[layer]  # None unless int8
    # the CPU kernel takes one head size for K and V (latent attention's differ: the torch path)
    kernel = meta.attention_kernel if key.shape[-1] == value.shape[-1] else None

    chunk = None
    if (pattern := meta.mask_patterns.get(layer)) is not None:  # what the model says only in its mask
        sliding_window = pattern.window if pattern.window is not None else sliding_window
        chunk = pattern.chunk

    q = query[0].transpose(0, 1)  # [T, H, Dk]
    out = q.new_empty(q.shape[0], q.shape[1], value.shape[-1])  # [T, H, Dv]
    if meta.segments is not None:
        if meta.segments.uncovered_rows:  # a graph's padded rows that no segment attends: zeros, not garbage
            out.zero_()
        from batching import triton_attention  # imports triton: only on the path that runs it

        sinks = None if s_aux is None else s_aux.reshape(-1)  # [H]
        triton_attention.attend(
            q, cache.k_blocks[layer], cache.v_blocks[layer], out, meta.segments, cache.block_size,
            scale, softcap, sinks, sliding_window, chunk, k_scales, v_scales,
        )  # fmt: skip
        return out.unsqueeze(0), None
    for group in meta.decodes:
        if kernel is not None and chunk is None:
            kernel.decode(
                q[group.start : group.end],
                cache.k_blocks[layer],
                cache.v_blocks[layer],
                group.block_ids,
                group.width,
                group.context_lens,
                out[group.start : group.end],
                scale,
                softcap,
                s_aux,
                sliding_window,
                k_scales,
                v_scales,
            )
            continue
        n = group.end - group.start
        kd, vd = cache.gather(layer, group.block_ids)  # [Hkv, n * L, Dk], [Hkv, n * L, Dv]
        kd, vd = kd.view(kd.shape[0], n, -1, kd.shape[-1]), vd.view(vd.shape[0], n, -1, vd.shape[-1])
        mask = group.mask(sliding_window, cache.block_size, chunk)
        out[group.start : group.end] = _decode_attention(
            q[group.start : group.end], kd, vd, mask, scale, softcap, s_aux
        )
    if kernel is not None and chunk is None and meta.prefill_tables is not None:
        kernel.prefill(
            q,
            cache.k_blocks[layer],
            cache.v_blocks[layer],
            meta.prefill_tables,
            out,
            scale,
            softcap,
            s_aux,
            sliding_window,
            k_scales,
            v_scales,
        )
    elif meta.prefills is not None:
        _attend_prefills(q, cache, layer, meta.prefills, out, scale, softcap, s_aux, sliding_window, chunk)
    return out.unsqueeze(0), None


def _attend_prefills(q, cache, layer: int, chunks, out, scale, softcap, sinks, sliding_window, chunk) -> None:
    """Every prompt chunk of the step in one padded batch: one gather of all their contexts, one
    attention call. q, out: [T, H, D]; chunks: PaddedPrefills."""
    num_chunks, width = chunks.rows.shape[0], chunks.width
    k, v = cache.gather(layer, chunks.block_ids)  # [Hkv, C * width * block_size, D]
    k = k.view(k.shape[0], num_chunks, -1, k.shape[-1]).transpose(0, 1)  # [C, Hkv, L, Dk]
    v = v.view(v.shape[0], num_chunks, -1, v.shape[-1]).transpose(0, 1)  # [C, Hkv, L, Dv]
    k_pos = torch.arange(width * cache.block_size, device=q.device)  # [L]
    q_pos = chunks.q_pos[..., None]  # [C, qmax, 1]
    mask = (k_pos <= q_pos) & chunks.valid[..., None]  # [C, qmax, L]; a padded query sees nothing
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    if chunk is not None:
        mask &= k_pos >= q_pos // chunk * chunk
    qp = q[chunks.rows].transpose(1, 2)  # [C, H, qmax, Dk]
    res = _prefill_attention(qp, k, v, mask[:, None], scale, softcap, sinks)  # [C, H, qmax, Dv]
    out[chunks.rows[chunks.valid]] = res.transpose(1, 2)[chunks.valid]


def _decode_attention(q, k, v, mask, scale, softcap, sinks):
    """One query per sequence. q: [Nd, H, Dk]; k: [Hkv, Nd, L, Dk]; v: [.., Dv]; mask: [1, Nd, 1, L]. → [Nd, H, Dv].

    Queries are grouped by their KV head ([Hkv, Nd, rep, D]) so K/V are never repeated per head.
    """
    nd, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[0]
    rep = num_heads // num_kv_heads
    qg = q.view(nd, num_kv_heads, rep, head_dim).transpose(0, 1)  # [Hkv, Nd, rep, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [Hkv, Nd, rep, L]
    probs = _softmax(scores, mask, softcap, None if sinks is None else sinks.view(num_kv_heads, 1, rep, 1))
    return torch.matmul(probs, v).transpose(0, 1).reshape(nd, num_heads, v.shape[-1])


def _prefill_attention(q, k, v, mask, scale, softcap, sinks):
    """q: [C, H, q, Dk]; k: [C, Hkv, L, Dk]; v: [C, Hkv, L, Dv]; mask: [C, 1, q, L] bool. → [C, H, q, Dv].

    A query row that may see no key (padding) comes out NaN: callers drop those rows."""
    k, v = _repeat_kv(k, q), _repeat_kv(v, q)
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [1, H, q, L]
    return torch.matmul(_softmax(scores, mask, softcap, None if sinks is None else sinks.view(-1, 1, 1)), v)


def _softmax(scores, mask, softcap, sinks):
    """Masked softmax over the last dim, with Gemma-2 soft-capping and gpt-oss attention sinks."""
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    # a sink is one extra logit per head that takes probability mass but has no value
    sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)  # sinks come shaped per head, [..., 1]
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)
    return probs[..., :-1]


def _repeat_kv(kv: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    rep = q.shape[1] // kv.shape[1]
    return kv if rep == 1 else kv.repeat_interleave(rep, dim=1)
