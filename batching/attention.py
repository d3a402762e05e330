"""Paged attention, registered with transformers' AttentionInterface.

The model's own attention modules compute q/k/v (and RoPE) and call `paged_attention`. It writes the
step's new K/V into cache slots, then attends each sequence's queries over its cached context.
Per-step metadata arrives explicitly through the forward's kwargs (`genq_attn=`), never as a global;
models that do not pass those kwargs down (falcon, gptj, gpt_neo: attention_classes.py) read it from
`step_context`, a context variable the runner sets around each forward.
Decode tokens (one query per sequence) are attended in a few batched calls, grouped by context
length so little padding is gathered, and prefill chunks one by one; on the CPU, kernels that read the
paged blocks in place attend both (batching/cpu_attention.py).
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from batching.cpu_attention import PagedAttentionKernel, PrefillTables
from batching.kv_cache import KVCache

ATTENTION_NAME = "genq_paged"


@dataclass(slots=True)
class PrefillChunk:
    start: int  # the chunk's rows in the packed batch: [start, end)
    end: int
    context_len: int  # cached + new tokens this chunk attends over
    block_ids: (
        torch.Tensor | None
    )  # [ceil(context_len / block_size)]; None when the chunk is the whole context


@dataclass(slots=True)
class DecodeGroup:
    """Single-query sequences of similar context length, attended in one batched call."""

    start: int  # rows [start, end) of the packed batch, one per sequence
    end: int
    block_ids: torch.Tensor  # [n * width] block tables, padded to `width` blocks, flattened
    context_lens: torch.Tensor  # [n]
    width: int  # blocks per sequence after padding
    _masks: dict = field(default_factory=dict)  # by sliding window, built once per step

    def mask(self, sliding_window: int | None, block_size: int, chunk: int | None = None) -> torch.Tensor:
        """[1, n, 1, width * block_size] bool, True where the query may attend."""
        mask = self._masks.get((sliding_window, chunk))
        if mask is None:
            lens = self.context_lens[:, None]
            pos = torch.arange(self.width * block_size, device=lens.device)[None, :]
            mask = pos < lens
            if sliding_window is not None:
                mask &= pos > lens - 1 - sliding_window
            if chunk is not None:  # the query (at lens - 1) sees its own chunk only
                mask &= pos >= (lens - 1) // chunk * chunk
            mask = self._masks[(sliding_window, chunk)] = mask[None, :, None, :]
        return mask


@dataclass(slots=True)
class AttentionMetadata:
    kv_cache: KVCache
    slot_mapping: torch.Tensor  # [T] cache slot of every packed token
    decodes: list[DecodeGroup]  # single-query rows come first in the packed batch
    prefills: list[PrefillChunk]
    attention_kernel: PagedAttentionKernel | None = (
        None  # attends from the blocks in place (CPU); None: torch
    )
    prefill_tables: PrefillTables | None = None  # the prefill chunks as the CPU kernel reads them
    mask_patterns: dict = field(default_factory=dict)  # layer -> MaskPattern: windows/chunks of the mask only


_step: ContextVar[object | None] = ContextVar("genq_step", default=None)


@contextlib.contextmanager
def step_context(meta):
    """The step's metadata for attention layers that receive no forward kwargs, during one forward."""
    token = _step.set(meta)
    try:
        yield
    finally:
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
    # the cache holds each layer at its own geometry (kv_cache.py): its KV heads, K and V head sizes
    k_cache, v_cache = cache.k[layer], cache.v[layer]  # [Hkv, S, Dk], [Hkv, S, Dv]
    k_cache.index_copy_(1, meta.slot_mapping, key[0])
    v_cache.index_copy_(1, meta.slot_mapping, value[0])
    # the CPU kernel takes one head size for K and V (latent attention's differ: the torch path)
    kernel = meta.attention_kernel if key.shape[-1] == value.shape[-1] else None

    chunk = None
    if (pattern := meta.mask_patterns.get(layer)) is not None:  # what the model says only in its mask
        sliding_window = pattern.window if pattern.window is not None else sliding_window
        chunk = pattern.chunk

    q = query[0].transpose(0, 1)  # [T, H, Dk]
    out = q.new_empty(q.shape[0], q.shape[1], value.shape[-1])  # [T, H, Dv]
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
            )
            continue
        n = group.end - group.start
        kd, vd = cache.gather(layer, group.block_ids)  # [Hkv, n * L, Dk], [Hkv, n * L, Dv]
        kd, vd = kd.view(kd.shape[0], n, -1, kd.shape[-1]), vd.view(vd.shape[0], n, -1, vd.shape[-1])
        mask = group.mask(sliding_window, cache.block_size, chunk)
        out[group.start : group.end] = _decode_attention(
            q[group.start : group.end], kd, vd, mask, scale, softcap, s_aux
        )
    prefills = meta.prefills
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
        )
        prefills = []
    for prefill in prefills:
        qp = query[:, :, prefill.start : prefill.end]  # [1, H, q, Dk]
        if prefill.block_ids is None:
            kp, vp = key[:, :, prefill.start : prefill.end], value[:, :, prefill.start : prefill.end]
        else:
            kp, vp = cache.gather(layer, prefill.block_ids)  # [Hkv, >= L, D]
            kp, vp = kp[None, :, : prefill.context_len], vp[None, :, : prefill.context_len]  # [1, Hkv, L, D]
        mask = _causal_mask(prefill.end - prefill.start, prefill.context_len, sliding_window, q.device, chunk)
        out[prefill.start : prefill.end] = _prefill_attention(qp, kp, vp, mask, scale, softcap, s_aux)[
            0
        ].transpose(0, 1)
    return out.unsqueeze(0), None


def _causal_mask(
    q_len: int, kv_len: int, sliding_window: int | None, device, chunk: int | None = None
) -> torch.Tensor:
    """[q, L] bool: query j (at position kv_len - q_len + j) sees keys up to its own position."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    if chunk is not None:
        mask &= k_pos >= q_pos // chunk * chunk
    return mask


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
    """q: [1, H, q, Dk]; k: [1, Hkv, L, Dk]; v: [1, Hkv, L, Dv]; mask: [q, L] bool. → [1, H, q, Dv]."""
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
