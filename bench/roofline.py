"""The roofline of a run: the bytes and FLOPs of the packed steps an engine ran, the device's measured
bandwidth and matmul rate, and the time that the slower of the two allows each step.

What a step counts (activations, norms, RoPE, the sampler and the logits themselves are left out):

- bytes read and written, in the run's dtype:
  - the weights, read once per step: every parameter but the embedding table, of which only the step's
    token rows are read (the whole table when it is tied to the LM head, which reads it all);
  - the KV that attention reads: for each sequence, its context after the step (cached + scheduled
    tokens) x attention layers x 2 (K and V) x kv_heads x head_dim;
  - the KV written: each scheduled token's K and V in every attention layer.
- FLOPs: 2 x the matmul parameters of the decoder layers (projections and MLP, with their biases) x the
  step's tokens; 2 x vocab x hidden for each logits row (the LM head runs on those rows only); and
  attention's 4 x q_heads x head_dim per (query, key) pair (QK^T and PV), causal: a chunk's i-th query
  (0-based) of a sequence with c tokens cached attends c + i + 1 keys.

The per-step bound is max(bytes / bandwidth, FLOPs / matmul rate); the run's roofline time is their sum,
and an engine's fraction of it is that time over the engine's measured time (1.0 = at the limit).

Weights are counted from the config for Llama-family decoders (llama, mistral, qwen2, qwen3: checked
against the real transformers model in tests/bench/test_roofline.py); any other architecture is built
on the meta device (no memory) and its parameters counted there. Layers without KV (the state layers of
a hybrid, per `config.layer_types`) count their weights, not their state.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from functools import partial

import torch

from batching import cpu_linear

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True, slots=True)
class Step:
    """One packed forward: for each sequence, the tokens it had cached before the step and the tokens
    it ran in it (1 for a decode, a chunk's length for a prefill), and the logits rows computed."""

    cached: tuple[int, ...]
    scheduled: tuple[int, ...]
    rows: int

    @property
    def tokens(self) -> int:
        return sum(self.scheduled)


def scheduled_step(sched) -> Step | None:
    """The Step of a scheduler output (`seqs`, `num_scheduled_tokens`; each sequence's
    `num_computed_tokens` and `num_tokens` as they stand when it is scheduled), read only; None for a
    step that runs no forward. A sequence samples (gets a logits row) when the step reaches its end."""
    pairs = [(s, n) for s, n in zip(sched.seqs, sched.num_scheduled_tokens, strict=True) if n > 0]
    if not pairs:
        return None
    cached = tuple(s.num_computed_tokens for s, _ in pairs)
    rows = sum(c + n >= s.num_tokens for (s, n), c in zip(pairs, cached, strict=True))
    return Step(cached, tuple(n for _, n in pairs), rows)


@dataclass(frozen=True, slots=True)
class Shape:
    """What the counts need from a model's config. Parameter counts are in elements."""

    layers: int
    kv_layers: int  # layers with a KV cache (full attention)
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    params: int  # every parameter once (a tied LM head shares the embedding's)
    embedding: int  # the input embedding table
    tied: bool  # the LM head is the embedding table
    matmul: int  # the decoder layers' projections and MLP (weights and biases), all layers


def shape(config) -> Shape:
    config = getattr(config, "text_config", None) or config
    layers = config.num_hidden_layers
    hidden, q_heads = config.hidden_size, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or q_heads
    head_dim = getattr(config, "head_dim", None) or hidden // q_heads
    types = getattr(config, "layer_types", None)
    kv_layers = sum(t == "full_attention" for t in types) if types else layers
    vocab, tied = config.vocab_size, bool(getattr(config, "tie_word_embeddings", False))
    embedding = vocab * hidden
    if config.model_type in LLAMA_FAMILY:
        q, kv = q_heads * head_dim, kv_heads * head_dim
        if config.model_type == "qwen2":
            attn_bias = q + 2 * kv  # q, k and v have biases, o has none
        else:
            attn_bias = (q + 2 * kv + hidden) * bool(getattr(config, "attention_bias", False))
        inter = config.intermediate_size
        mlp_bias = (2 * inter + hidden) * bool(getattr(config, "mlp_bias", False))
        per_layer = hidden * q + 2 * hidden * kv + q * hidden + attn_bias + 3 * hidden * inter + mlp_bias
        norms = 2 * hidden + (2 * head_dim if config.model_type == "qwen3" else 0)  # + q/k norms
        params = embedding + layers * (per_layer + norms) + hidden + (0 if tied else embedding)
        return Shape(
            layers,
            kv_layers,
            hidden,
            q_heads,
            kv_heads,
            head_dim,
            vocab,
            params,
            embedding,
            tied,
            layers * per_layer,
        )
    params, matmul = _meta_counts(config)
    return Shape(
        layers, kv_layers, hidden, q_heads, kv_heads, head_dim, vocab, params, embedding, tied, matmul
    )


def _meta_counts(config) -> tuple[int, int]:
    """(every parameter, the nn.Linear parameters but the LM head's) of the model built on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    params = sum(p.numel() for p in model.parameters())
    linear = sum(
        p.numel()
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and m is not head
        for p in m.parameters(recurse=False)
    )
    return params, linear


def param_bytes(config, dtype: torch.dtype) -> int:
    """Every parameter's bytes in `dtype`: sum(p.numel() * p.element_size()) of the model."""
    return shape(config).params * dtype.itemsize


def step_traffic(config, dtype: torch.dtype, step: Step) -> tuple[int, int, int]:
    """(weight bytes read, KV bytes read, KV bytes written) by one step."""
    s = config if isinstance(config, Shape) else shape(config)
    size = dtype.itemsize
    unread = 0 if s.tied else max(s.embedding - step.tokens * s.hidden, 0)  # embedding rows not looked up
    weights = (s.params - unread) * size
    per_token = s.kv_layers * 2 * s.kv_heads * s.head_dim * size
    kv_read = sum(c + n for c, n in zip(step.cached, step.scheduled, strict=True)) * per_token
    return weights, kv_read, step.tokens * per_token


def step_bytes(config, dtype: torch.dtype, step: Step) -> int:
    """The bytes one step moves: weights read, KV read, KV written."""
    return sum(step_traffic(config, dtype, step))


def step_flops(config, step: Step) -> int:
    """The FLOPs of one step: the layers' matmuls, the LM head's rows, attention's QK^T and PV."""
    s = config if isinstance(config, Shape) else shape(config)
    pairs = sum(n * c + n * (n + 1) // 2 for c, n in zip(step.cached, step.scheduled, strict=True))
    return (
        2 * s.matmul * step.tokens
        + 2 * s.vocab * s.hidden * step.rows
        + 4 * s.q_heads * s.head_dim * pairs * s.kv_layers
    )


@dataclass(frozen=True, slots=True)
class DeviceRates:
    """A device's measured limits: bytes/s (the better of a copy and a sum of a large tensor) and FLOP/s
    (a large square matmul; on the CPU the better of torch.mm and oneDNN with a packed weight, genq's
    linears), in the run's dtype."""

    device: str
    dtype: str
    bandwidth: float  # bytes/s: max(copy_bandwidth, sum_bandwidth)
    matmul: float  # FLOP/s
    copy_bandwidth: float  # (read + written) / s of dst.copy_(src)
    sum_bandwidth: float  # read / s of src.sum()
    tensor_bytes: int
    matmul_n: int

    def as_dict(self) -> dict:
        return asdict(self)


def _best_seconds(fn, device: str, repeat: int) -> float:
    cuda = device.startswith("cuda")
    fn()  # warm-up: allocation, kernel selection
    best = float("inf")
    for _ in range(repeat):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def measure_device(
    device: str,
    dtype: torch.dtype,
    tensor_bytes: int | None = None,
    matmul_n: int | None = None,
    repeat: int = 5,
) -> DeviceRates:
    """Measure `device`'s memory bandwidth and matmul rate in `dtype`, the best of `repeat` timings each
    (CUDA synchronised): a tensor well past the caches (256 MiB on the CPU, 1 GiB on CUDA) copied and
    summed, and an n x n matmul (n = 2048 on the CPU, 8192 on CUDA)."""
    cuda = device.startswith("cuda")
    tensor_bytes = tensor_bytes or (1 << 30 if cuda else 1 << 28)
    n = matmul_n or (8192 if cuda else 2048)
    with torch.inference_mode():
        src = torch.ones(tensor_bytes // dtype.itemsize, dtype=dtype, device=device)
        dst = torch.empty_like(src)
        copy_s = _best_seconds(partial(dst.copy_, src), device, repeat)
        sum_s = _best_seconds(src.sum, device, repeat)
        del src, dst
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        mm_s = _best_seconds(partial(torch.mm, a, b), device, repeat)
        if not cuda and cpu_linear.available(dtype, torch.device(device)):
            # genq's linears (batching/cpu_linear.py): on the Zen 5 in float32 twice torch.mm's MKL rate, so
            # torch.mm alone gave a bound genq beat (110-147% of it)
            packed = torch.ops.mkldnn._reorder_linear_weight(b.t().contiguous(), cpu_linear.PACK_BATCH_HINT)
            linear = partial(torch.ops.mkldnn._linear_pointwise, a, packed, None, "none", [], "")
            mm_s = min(mm_s, _best_seconds(linear, device, repeat))
    copy_bw, sum_bw = 2 * tensor_bytes / copy_s, tensor_bytes / sum_s
    return DeviceRates(
        device,
        str(dtype).removeprefix("torch."),
        max(copy_bw, sum_bw),
        2 * n**3 / mm_s,
        copy_bw,
        sum_bw,
        tensor_bytes,
        n,
    )


def roofline(config, dtype: torch.dtype, steps: list[Step], rates: DeviceRates) -> dict:
    """The run's totals and its roofline time: per step max(bytes / bandwidth, FLOPs / matmul rate), summed.
    `memory_bound_steps` counts the steps whose bound is the bytes."""
    s = shape(config)
    weights = kv_read = kv_written = flops = 0
    bound = 0.0
    memory_bound = 0
    for step in steps:
        w, r, wr = step_traffic(s, dtype, step)
        f = step_flops(s, step)
        weights, kv_read, kv_written, flops = weights + w, kv_read + r, kv_written + wr, flops + f
        t_bytes, t_flops = (w + r + wr) / rates.bandwidth, f / rates.matmul
        bound += max(t_bytes, t_flops)
        memory_bound += t_bytes >= t_flops
    return dict(
        steps=len(steps),
        tokens=sum(st.tokens for st in steps),
        bytes=weights + kv_read + kv_written,
        weight_bytes=weights,
        kv_read_bytes=kv_read,
        kv_written_bytes=kv_written,
        flops=flops,
        bound_seconds=bound,
        memory_bound_steps=memory_bound,
    )
