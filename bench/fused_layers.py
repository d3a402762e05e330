"""genq with fused decoder layers (batching/fused_layers.py) against the same engine unfused, in one run.

On the record model of bench/engine_throughput.py (hidden 512, 8 layers) and one of its workloads, two
engines over the same checkpoint, `cpu_fused_layers` on and off (both with the packed linears and the C++
attention), run the workload in alternating passes; the fastest pass of each counts. `--profile` instead
prints, for each engine, torch.profiler's ops of a decode step at full width and of a prefill step, by self
CPU time (where a step's time goes, and what the fusion took out).

    python bench/fused_layers.py --workload record --dtype float32 --repeat 3
    python bench/fused_layers.py --profile --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing
from bench import engine_throughput as et  # noqa: E402
from bench.harness import Interference, code_version, wait_for_quiet  # noqa: E402


def make_engine(model_dir: str, reqs, dtype: str, fused: bool):
    from batching import Engine, EngineConfig

    num_blocks = sum(-(-(len(p) + n) // 16) for p, n in reqs) + 64
    return Engine(
        EngineConfig(
            model=model_dir,
            dtype=dtype,
            device="cpu",
            block_size=16,
            num_device_blocks=num_blocks,
            num_host_blocks=0,
            max_num_seqs=et.MAX_NUM_SEQS,
            max_num_batched_tokens=et.BUDGET,
            max_model_len=2048,
            cpu_fused_layers=fused,
        )
    )


def fused_count(engine) -> int:
    return sum(type(m).__name__.startswith("Fused") for m in et.find_torch_model(engine).modules())


def profile(engine, label: str, reqs) -> None:
    """Ops of one full-width decode step and of one prefill step, by self CPU time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from batching import SamplingParams

    decode_reqs = [(p[:32], 64) for p, _ in reqs[: et.MAX_NUM_SEQS]]
    for i, (p, n) in enumerate(decode_reqs):
        engine.add_request(f"d{i}", p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    for _ in range(8):  # prefills done, every sequence decoding
        engine.step()
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            engine.step()
    print(f"\n=== {label}: 5 decode steps at width {len(decode_reqs)} ===")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("p", [5 + i % 8000 for i in range(et.BUDGET)], SamplingParams(max_tokens=1))
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    print(f"\n=== {label}: a prefill step of {et.BUDGET} tokens ===")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
    while engine.has_unfinished_requests():
        engine.step()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=sorted(et.WORKLOADS), default="record")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--wait-quiet", type=float, default=0.0, metavar="S")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    n, prompt_range, output_range = et.WORKLOADS[args.workload]
    reqs = et.make_workload(n, args.seed, prompt_range, output_range)
    useful = et.useful_tokens(reqs)
    warm = et.make_workload(4, args.seed + 1, prompt_range=(8, 32), output_range=(4, 8))
    print(
        f"workload {args.workload} ({n} requests, {useful} output tokens), {args.dtype}, "
        f"{torch.get_num_threads()} threads, code {code_version()}, load {os.getloadavg()}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = et.build_model_dir(tmp, args.seed)
        engines = {
            key: make_engine(model_dir, reqs, args.dtype, key == "fused") for key in ("fused", "unfused")
        }
        print({key: f"{fused_count(e)} fused layers" for key, e in engines.items()})
        if args.profile:
            for key, engine in engines.items():
                profile(engine, key, reqs)
            return {}
        for engine in engines.values():
            et.genq_run(engine, warm, False)
        best: dict[str, float] = {}
        tokens: dict[str, list] = {}
        for k in range(args.repeat):
            for key in list(engines) if k % 2 == 0 else list(engines)[::-1]:
                engine = engines[key]
                engine.block_manager.reset_prefix_cache()
                if args.wait_quiet:
                    wait_for_quiet(args.wait_quiet)
                with Interference(None) as load:
                    t0 = time.perf_counter()
                    out = et.genq_run(engine, reqs, False)
                    elapsed = time.perf_counter() - t0
                tok_s = useful / elapsed
                tokens.setdefault(key, out)
                best[key] = max(best.get(key, 0.0), tok_s)
                print(
                    f"  pass {k + 1} {key}: {tok_s:,.1f} tok/s (others {'-' if load.share is None else f'{load.share:.0%}'})",
                    flush=True,
                )
    same = sum(a == b for a, b in zip(tokens["fused"], tokens["unfused"]))
    print(
        f"fused {best['fused']:,.1f} tok/s, unfused {best['unfused']:,.1f} tok/s: "
        f"{best['fused'] / best['unfused']:.3f}x; identical outputs {same}/{len(reqs)}; load {os.getloadavg()}"
    )
    return dict(best=best, identical=same)


if __name__ == "__main__":
    main()
