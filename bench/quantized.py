"""Quantized checkpoints in genq's engine: tokens/s and memory per sequence, against the plain model in the same run.

Model: engine_throughput.py's record Llama (hidden 512, 8 layers, vocab 8192, seeded random float32
weights), saved once; each quantization is that checkpoint quantized by transformers (torchao through
`TorchAoConfig`, as a user would) and saved beside it, and genq loads each by path. Workload:
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
- KV/seq: the KV cache bytes of one sequence of the workload's mean length (prompt + new tokens);
- memory/seq at width 64: the weights shared by the 64 sequences of a full batch, plus one's KV;
- match: genq's greedy tokens on the first `--check` requests against transformers' own `generate()` on the
  same quantized model (fraction of matching prefix tokens; exact is 100%).

    python bench/quantized.py                       # plain vs int8 weight-only, 32 requests
    python bench/quantized.py --with int4,float8 --repeat 2 --threads 2
    python bench/quantized.py --quick               # smoke run
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, TorchAoConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing
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
    "int8": "torchao int8 weight-only",
    "int4": "torchao int4 weight-only (intx, groups of 32)",
    "float8": "torchao float8 weight-only",
}


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
    return KVCache.bytes_per_block(kv.layers, kv.block_size, engine.dtype) * num_tokens / kv.block_size


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32, help="requests of the record workload")
    ap.add_argument(
        "--with", dest="extra", default="", help="more quantizations: int4, float8 (comma-separated)"
    )
    ap.add_argument("--repeat", type=int, default=1, help="round-robin passes; the fastest of each counts")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--check", type=int, default=4, help="requests compared with generate()")
    ap.add_argument("--seed", type=int, default=0)
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
    names = ["plain", "int8", *[n for n in args.extra.split(",") if n]]
    mean_len = sum(len(p) + n for p, n in reqs) / len(reqs)

    with tempfile.TemporaryDirectory(prefix="genq-quantized-") as tmp:
        dirs = {"plain": build_model_dir(f"{tmp}/plain", args.seed)}
        for name in names[1:]:
            dirs[name] = quantize_checkpoint(dirs["plain"], name, f"{tmp}/{name}")
        systems = {}
        for name in names:
            print(f"loading {LABELS[name]} ...", flush=True)
            systems[name] = GenqSystem(dirs[name], reqs, "cpu", warm)
            systems[name].label = LABELS[name]
        results = run_passes(systems, args.repeat, useful_tokens(reqs))
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
            f"{f['kv_bytes_per_seq'] / 2**10:.0f}",
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
        "KV/seq KiB",
        f"memory/seq at width {WIDTH}, KiB (vs plain)",
        "match generate()",
        "others",
    )
    figures_out = dict(requests=len(reqs), mean_tokens=mean_len, threads=args.threads, systems=figures)
    write_result("quantized", figures_out, markdown_table(header, rows), args.json, run=run)


if __name__ == "__main__":
    main()
