"""Quantized checkpoints and the 8-bit KV cache in genq's engine: tokens/s and memory per sequence, against the
plain model in the same run, and the 8-bit KV cache's error against the full-precision cache.

Model: engine_throughput.py's record Llama (hidden 512, 8 layers, vocab 8192, seeded random float32
weights), saved once; each quantization is that checkpoint quantized by transformers (torchao through
`TorchAoConfig`, as a user would) and saved beside it, and genq loads each by path; "kv8" is the plain
checkpoint with `EngineConfig(kv_cache_dtype="int8")` (batching/kv_cache.py). Workload:
engine_throughput.py's record workload (random prompts of 16-256 tokens, 16-128 new, greedy, EOS ignored),
`--requests` of it, run by engine_throughput's `GenqSystem` (the same engine settings: budget 512, 64
sequences, blocks for the whole workload, no preemption), float32 activations. Systems run in
round-robin passes (`--repeat`), the fastest pass of each counts, with the share of the CPU other processes
took meanwhile.

Per system:
- tok/s: useful generated tokens / wall time of the pass, and the ratio to the plain model's;
- tok/CPU-s: the same tokens / CPU seconds this process used (on a shared machine, the cost of the path);
- weights: the bytes of the model's parameters and buffers as stored (a quantized tensor's inner tensors:
  torchao's int8 data and scales), and the ratio to the plain model's;
- KV/seq: the KV cache bytes of one sequence of the workload's mean length (prompt + new tokens), scales
  included, and how many such sequences 1 GiB of KV holds;
- memory/seq at width 64: the weights shared by the 64 sequences of a full batch, plus one's KV;
- match: genq's greedy tokens on the first `--check` requests against transformers' own `generate()` on the
  same quantized model (fraction of matching prefix tokens; exact is 100%).

The 8-bit KV cache against the full-precision one (the same model, engine and workload):
- greedy: the share of kv8's generated tokens that match the plain cache's before their first difference,
  over every request, and the requests whose whole output is equal;
- teacher-forced: each of the first `--accuracy` requests as one sequence (its prompt and the plain cache's
  greedy output), prefilled by both engines with prompt log-probabilities: the mean and the largest
  |log p(token)| difference over the output positions, and how often the most likely next token agrees.

    python bench/quantized.py                       # plain vs int8 weight-only vs 8-bit KV, 32 requests
    python bench/quantized.py --with int4,float8 --repeat 2 --threads 2
    python bench/quantized.py --quick               # smoke run
    python bench/quantized.py --model PATH          # a saved checkpoint (a trained model) instead
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, TorchAoConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing
from batching import SamplingParams  # noqa: E402
from batching.cpu_linear import PackedLinear  # noqa: E402
from batching.kv_cache import KVCache  # noqa: E402
from bench.engine_throughput import (  # noqa: E402
    WORKLOADS,
    GenqSystem,
    build_model_dir,
    load_hf_model,
    make_workload,
    prefix_match,
    reference_tokens,
    run_passes,
    useful_tokens,
)
from bench.harness import markdown_table, run_info, write_result  # noqa: E402

WIDTH = 64  # GenqSystem's max_num_seqs: the batch a full engine shares its weights over


def torchao_config(name: str):
    """The torchao config of each quantization this bench can run (all weight-only: genq runs those)."""
    from torchao import quantization
    from torchao.quantization.granularity import PerGroup

    return {
        "int8": lambda: quantization.Int8WeightOnlyConfig(),
        "int4": lambda: quantization.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)),
        "float8": lambda: quantization.Float8WeightOnlyConfig(),
    }[name]()


LABELS = {
    "plain": "plain float32",
    "kv8": "plain float32, 8-bit KV cache (int8 + scales)",
    "int8": "torchao int8 weight-only",
    "int4": "torchao int4 weight-only (intx, groups of 32)",
    "float8": "torchao float8 weight-only",
}


ENGINE_OPTIONS = {"kv8": dict(kv_cache_dtype="int8")}  # systems that run the plain checkpoint otherwise


def quantize_checkpoint(plain_dir: str, name: str, directory: str) -> str:
    model = AutoModelForCausalLM.from_pretrained(
        plain_dir, dtype=torch.float32, quantization_config=TorchAoConfig(torchao_config(name))
    )
    model.save_pretrained(directory)
    return directory


def stored_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers as they are stored: a tensor subclass (torchao's quantized
    weights) by its inner tensors; a tensor shared between modules (tied weights) once."""
    seen: set[int] = set()

    def size(t: torch.Tensor) -> int:
        flatten = getattr(t, "__tensor_flatten__", None)
        if flatten is not None and type(t) not in (torch.Tensor, torch.nn.Parameter):
            names, _ = flatten()
            return sum(size(getattr(t, n)) for n in names)
        if t.is_mkldnn:  # oneDNN's opaque layout: no storage to read, its elements are its bytes
            return t.numel() * t.element_size()
        if t.untyped_storage().data_ptr() in seen:
            return 0
        seen.add(t.untyped_storage().data_ptr())
        return t.untyped_storage().nbytes()

    tensors = [*model.parameters(), *model.buffers()]
    # oneDNN's packed copies of plain weights (batching/cpu_linear.py), whose parameters it released
    tensors += [m.packed_weight for m in model.modules() if isinstance(m, PackedLinear)]
    return sum(size(t) for t in tensors)


def kv_bytes_per_sequence(engine, num_tokens: float) -> float:
    kv = engine.kv_cache
    block_bytes = KVCache.bytes_per_block(
        kv.layers, kv.block_size, engine.dtype, engine.config.kv_cache_dtype
    )
    return block_bytes * num_tokens / kv.block_size


def teacher_forced(engine, sequences: list[list[int]]) -> list[list]:
    """Each sequence's prompt log-probabilities (with the most likely token at each position), prefilled
    with nothing reused from the prefix cache."""
    engine.block_manager.reset_prefix_cache()
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=1)
    return [out.prompt_logprobs for out in engine.generate(sequences, params)]


def kv8_accuracy(systems, results, reqs, n: int) -> dict:
    """The 8-bit KV cache against the full-precision one: greedy prefix match over the workload, and
    teacher-forced log-probability error and top-1 agreement over the first n requests' outputs."""
    match, equal = prefix_match(results["kv8"]["tokens"], results["plain"]["tokens"])
    sequences = [
        list(p) + list(t) for (p, _), t in zip(reqs[:n], results["plain"]["tokens"][:n], strict=True)
    ]
    full = teacher_forced(systems["plain"].engine, sequences)
    kv8 = teacher_forced(systems["kv8"].engine, sequences)
    errors, agree = [], 0
    for (prompt, _), a, b in zip(reqs[:n], full, kv8, strict=True):
        # prompt_logprobs[i] is token i + 1's: the output's tokens are those from len(prompt) - 1 on
        for x, y in zip(a[len(prompt) - 1 :], b[len(prompt) - 1 :], strict=True):
            errors.append(abs(x.logprob - y.logprob))
            agree += x.top[0][0] == y.top[0][0]
    return dict(
        greedy_prefix_match=match,
        greedy_equal_requests=equal,
        requests=len(reqs),
        teacher_forced_requests=len(sequences),
        teacher_forced_tokens=len(errors),
        logprob_error_mean=sum(errors) / len(errors),
        logprob_error_max=max(errors),
        top1_agreement=agree / len(errors),
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32, help="requests of the record workload")
    ap.add_argument(
        "--with", dest="extra", default="", help="more quantizations: int4, float8 (comma-separated)"
    )
    ap.add_argument("--repeat", type=int, default=1, help="round-robin passes; the fastest of each counts")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--check", type=int, default=4, help="requests compared with generate()")
    ap.add_argument(
        "--accuracy",
        type=int,
        default=16,
        help="requests teacher-forced through both KV caches (kv8's error)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--model", help="a saved checkpoint to run instead of the record Llama (e.g. a trained one)"
    )
    ap.add_argument("--quick", action="store_true", help="8 short requests: a smoke run")
    ap.add_argument("--json", help="write the figures here (default bench/out/quantized.json)")
    args = ap.parse_args(argv)
    run = run_info()
    torch.set_num_threads(args.threads)

    _, prompt_range, output_range = WORKLOADS["record"]
    if args.quick:
        args.requests, prompt_range, output_range = 8, (16, 64), (8, 16)
    reqs = make_workload(args.requests, args.seed, prompt_range, output_range)
    warm = make_workload(4, args.seed + 1, prompt_range=(8, 32), output_range=(4, 8))
    names = ["plain", "int8", "kv8", *[n for n in args.extra.split(",") if n]]
    mean_len = sum(len(p) + n for p, n in reqs) / len(reqs)

    with tempfile.TemporaryDirectory(prefix="genq-quantized-") as tmp:
        dirs = {"plain": args.model or build_model_dir(f"{tmp}/plain", args.seed)}
        for name in names[1:]:
            if name in ENGINE_OPTIONS:
                dirs[name] = dirs["plain"]
            else:
                dirs[name] = quantize_checkpoint(dirs["plain"], name, f"{tmp}/{name}")
        systems = {}
        for name in names:
            print(f"loading {LABELS[name]} ...", flush=True)
            systems[name] = GenqSystem(dirs[name], reqs, "cpu", warm, **ENGINE_OPTIONS.get(name, {}))
            systems[name].label = LABELS[name]
        results = run_passes(systems, args.repeat, useful_tokens(reqs))
        accuracy = kv8_accuracy(systems, results, reqs, min(args.accuracy, len(reqs)))
        checked = reqs[: args.check]
        matches = {}
        for name in names:
            reference = reference_tokens(load_hf_model(dirs[name], "cpu"), checked, "cpu")
            matches[name] = prefix_match(results[name]["tokens"][: args.check], reference)

    useful = useful_tokens(reqs)
    figures: dict[str, dict] = {}
    for name in names:
        best = min(range(len(results[name]["times"])), key=lambda i: results[name]["times"][i])
        engine = systems[name].engine
        weights = stored_bytes(engine.model)
        kv_seq = kv_bytes_per_sequence(engine, mean_len)
        figures[name] = dict(
            label=LABELS[name],
            tok_s=useful / results[name]["times"][best],
            tok_cpu_s=useful / (results[name]["own_cores"][best] * results[name]["times"][best]),
            others=results[name]["others"][best],
            weight_bytes=weights,
            kv_bytes_per_seq=kv_seq,
            memory_per_seq_at_width=weights / WIDTH + kv_seq,
            prefix_match=matches[name][0],
            equal_requests=matches[name][1],
        )
    plain = figures["plain"]
    rows = [
        (
            f["label"],
            f"{f['tok_s']:.0f} ({f['tok_s'] / plain['tok_s']:.2f}x)",
            f"{f['tok_cpu_s']:.0f} ({f['tok_cpu_s'] / plain['tok_cpu_s']:.2f}x)",
            f"{f['weight_bytes'] / 2**20:.1f} ({f['weight_bytes'] / plain['weight_bytes']:.2f}x)",
            f"{f['kv_bytes_per_seq'] / 2**10:.0f} ({2**30 / f['kv_bytes_per_seq']:.0f})",
            f"{f['memory_per_seq_at_width'] / 2**10:.0f} ({f['memory_per_seq_at_width'] / plain['memory_per_seq_at_width']:.2f}x)",
            f"{f['prefix_match']:.0%} ({f['equal_requests']}/{len(checked)})",
            f"{f['others']:.0%}" if f["others"] is not None else "-",
        )
        for f in figures.values()
    ]
    header = (
        "model",
        "tok/s (vs plain)",
        "tok/CPU-s (vs plain)",
        "weights MiB (vs plain)",
        "KV/seq KiB (seqs per GiB)",
        f"memory/seq at width {WIDTH}, KiB (vs plain)",
        "match generate()",
        "others",
    )
    figures_out = dict(
        requests=len(reqs), mean_tokens=mean_len, threads=args.threads, systems=figures, kv8_accuracy=accuracy
    )
    table = markdown_table(header, rows) + "\n\n" + accuracy_table(accuracy)
    write_result("quantized", figures_out, table, args.json, run=run)


def accuracy_table(a: dict) -> str:
    header = (
        "8-bit KV vs full-precision cache",
        "greedy prefix match",
        "equal requests",
        "teacher-forced tokens",
        "mean abs Δ log p",
        "max abs Δ log p",
        "top-1 agreement",
    )
    row = (
        "kv8",
        f"{a['greedy_prefix_match']:.1%}",
        f"{a['greedy_equal_requests']}/{a['requests']}",
        f"{a['teacher_forced_tokens']} ({a['teacher_forced_requests']} requests)",
        f"{a['logprob_error_mean']:.2e}",
        f"{a['logprob_error_max']:.2e}",
        f"{a['top1_agreement']:.2%}",
    )
    return markdown_table(header, [row])


if __name__ == "__main__":
    main()
