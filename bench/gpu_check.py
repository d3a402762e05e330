"""`make gpu-check`: one command that says whether genq is right on this machine's device and how fast.

1. The device tests: the exactness suites (parity with generate(), preemption, swap, prefix cache,
   per-layer KV geometry) on each engine path this machine has (tests/batching/conftest.py:
   ENGINE_PATHS; on CUDA the Triton kernel with CUDA graphs, and torch), the Triton path's own tests
   and the CUDA-only ones (graphs, copy stream and pinned pools, pool sizing). Without CUDA the
   same run on the CPU's paths (the C++ kernels, torch, Triton under its interpreter) and the
   CUDA-only tests are skipped, saying so.
2. The engine throughput bench (bench/engine_throughput.py) on the device: genq (its default path,
   and its torch attention) against transformers' continuous batching (`generate_batch`), and
   vLLM when VLLM_PYTHON names the python of an environment that has it. On CUDA: the workload of
   record in float32, then 256 requests on a 1B-parameter Llama in bfloat16 at a GPU's batch width;
   on the CPU: the quick workload of record.
3. The roofline of each bench (bench/roofline.py): the bytes and FLOPs of the steps genq ran against the
   device's bandwidth and matmul rate measured in the same run, and genq's fraction of it; the headline
   is that of the 1B bfloat16 width-256 workload (issue 38's target: >= 50%).
4. The engine's host work per step outside the forward (bench/host_overhead.py), and on CUDA the
   device's idle time between steps (issue 38's targets).
5. The figures, with the device named, in bench/out/gpu-check-<device>.md and .json.

    make gpu-check                      # with the project's virtual environment
    make gpu-check PY=python3           # with a python that already has torch, transformers, triton
    python bench/gpu_check.py --skip-tests    # the bench alone
    python bench/gpu_check.py --tests tests/batching/test_cuda.py --benches 1   # a short lease: the CUDA-only
                                              # tests, the 1B bf16 bench (roofline), the host work
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere without installing
from bench import engine_throughput, host_overhead  # noqa: E402

DEVICE_TESTS = [
    "tests/batching/test_exactness.py",
    "tests/batching/test_preemption.py",
    "tests/batching/test_swap.py",
    "tests/batching/test_prefix_cache.py",
    "tests/batching/test_kv_cache.py",
    "tests/batching/test_sampling.py",
    "tests/batching/test_attention_paths.py",
    "tests/batching/test_cuda.py",
]
CUDA_BENCHES = [
    ["--workload", "record", "--dtype", "float32"],
    [
        "--workload", "record", "--requests", "256", "--model", "1b", "--dtype", "bfloat16",
        "--max-num-seqs", "256", "--budget", "2048", "--skip", "static,forward",
    ],
]  # fmt: skip
CPU_BENCHES = [["--workload", "record", "--dtype", "float32", "--quick", "--skip", "static"]]
ROOFLINE_TARGET = 0.5  # issue 38: the 1B bfloat16 width-256 workload at >= 50% of its roofline


def is_roofline_headline(fig: dict) -> bool:
    """The 1B bfloat16 width-256 workload: the one whose roofline fraction issue 38 sets a target for."""
    return fig.get("model_size") == "1b" and fig["dtype"] == "bfloat16" and fig["max_num_seqs"] == 256


def roofline_lines(fig: dict) -> list[str]:
    """A bench's roofline as markdown: the device's measured rates, then a row per genq path."""
    if "roofline" not in fig:
        return []
    d = fig["roofline"]["device"]
    lines = [
        f"Roofline on {d['device']} in {d['dtype']}, measured in the same run: {d['bandwidth'] / 1e9:.0f} GB/s, "
        f"{d['matmul'] / 1e12:.2f} TFLOP/s.",
        "",
        "| genq | steps | GB moved | TFLOP | bound s | genq s | fraction |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key, e in fig["roofline"]["systems"].items():
        lines.append(
            f"| {key} | {e['steps']} | {e['bytes'] / 1e9:.2f} | {e['flops'] / 1e12:.3f} | {e['bound_seconds']:.3f} "
            f"| {e['genq_seconds']:.2f} | **{e['fraction']:.1%}** |"
        )
    return [*lines, ""]


def roofline_headline(figures: list[dict]) -> str | None:
    """genq's fraction of the roofline on the 1B bfloat16 width-256 workload, against the target."""
    for fig in figures:
        if is_roofline_headline(fig) and "genq" in fig.get("roofline", {}).get("systems", {}):
            fraction = fig["roofline"]["systems"]["genq"]["fraction"]
            verdict = "met" if fraction >= ROOFLINE_TARGET else "not met"
            return (
                f"Roofline, 1B bfloat16 width 256: genq at **{fraction:.1%}** of the bound "
                f"(target >= {ROOFLINE_TARGET:.0%}: {verdict})"
            )
    return None


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({os.cpu_count()} cores), no CUDA"


def run_tests(junit: Path, tests: list[str] | None = None) -> dict:
    env = dict(os.environ)
    if torch.cuda.is_available():  # the CPU's paths run in CI; here the device's
        env.setdefault("GENQ_TEST_PATHS", "cuda-triton,cuda-torch")
    command = [
        sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
        "--confcutdir", "tests/batching",  # the service fixtures (Postgres, Redis) are not needed here
        "-o", "filterwarnings=default",  # another torch or transformers may warn: report, do not fail
        "--durations=10",
        f"--junitxml={junit}", *(tests or DEVICE_TESTS),
    ]  # fmt: skip
    print("$", " ".join(command), flush=True)
    started = time.monotonic()
    result = subprocess.run(command, cwd=ROOT, env=env)
    counts = {"seconds": round(time.monotonic() - started, 1), "exit_code": result.returncode}
    if junit.exists():
        head = junit.read_text()[:2000]
        for key in ("tests", "failures", "errors", "skipped"):
            if match := re.search(rf'{key}="(\d+)"', head):
                counts[key] = int(match.group(1))
    return counts


def run_benches(out: Path, slug: str, only: set[int] | None = None) -> list[dict]:
    figures = []
    cuda = torch.cuda.is_available()
    for i, args in enumerate(CUDA_BENCHES if cuda else CPU_BENCHES):
        if only is not None and i not in only:
            continue
        path = out / f"gpu-check-{slug}-bench{i}.json"
        args = [*args, "--device", "cuda" if cuda else "cpu", "--json", str(path)]
        if os.environ.get("VLLM_PYTHON"):
            args += ["--vllm-python", os.environ["VLLM_PYTHON"]]
        print("$ python bench/engine_throughput.py", " ".join(args), flush=True)
        figures.append(engine_throughput.main(args))
    return figures


def run_host_overhead(out: Path, slug: str) -> dict:
    """bench/host_overhead.py on the device: the engine's host work per step, and on CUDA the device's idle
    time between steps."""
    print("$ python bench/host_overhead.py --widths 1,64,256", flush=True)
    report = host_overhead.measure_widths([1, 64, 256], 50, "cuda" if torch.cuda.is_available() else "cpu")
    (out / f"gpu-check-{slug}-host.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def markdown(device: str, tests: dict | None, figures: list[dict], host: dict | None = None) -> str:
    lines = [
        f"# gpu-check on {device}",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M')}, torch {torch.__version__}",
        "",
    ]
    if tests is not None:
        passed = (
            tests.get("tests", 0)
            - tests.get("failures", 0)
            - tests.get("errors", 0)
            - tests.get("skipped", 0)
        )
        verdict = "PASSED" if tests["exit_code"] == 0 else "FAILED"
        lines += [
            f"Device tests: **{verdict}**: {passed} passed, {tests.get('failures', 0)} failed, "
            f"{tests.get('errors', 0)} errors, {tests.get('skipped', 0)} skipped ({tests['seconds']} s).",
            "",
        ]
    for fig in figures:
        lines += [
            f"## {fig['workload']} workload, {fig['requests']} requests, model {fig.get('model_size', 'record')}, "
            f"{fig['dtype']}, width {fig['max_num_seqs']}, budget {fig['budget']}",
            "",
            "| system | tok/s | seconds |",
            "| --- | --- | --- |",
        ]
        for key in ("genq", "genq_torch", "vllm", "hf_generate_batch", "hf_generate_static", "forward_only"):
            if key in fig:
                label = key if key not in ("genq", "genq_torch") else f"genq ({fig[key].get('attention')})"
                lines.append(f"| {label} | {fig[key]['tok_s']:.0f} | {fig[key]['seconds']:.2f} |")
        lines += (
            [""] + [f"- {name}: **{ratio:.2f}x**" for name, ratio in fig.get("ratios", {}).items()] + [""]
        )
        lines += roofline_lines(fig)
    if host is not None:
        lines += ["## host work per step", "", *host_overhead.table(host), ""]
    if (headline := roofline_headline(figures)) is not None:
        lines[4:4] = [headline, ""]  # under the title, beside the test verdict
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument(
        "--tests",
        nargs="+",
        metavar="PATH",
        help="these tests instead of the whole device suite (a short device lease: tests/batching/test_cuda.py "
        "first, which holds the CUDA-only checks)",
    )
    ap.add_argument(
        "--benches",
        default=None,
        help="comma-separated indices of the benches to run (CUDA: 0 the record workload, 1 the 1B bfloat16 "
        "width-256 one); default all",
    )
    ap.add_argument("--out", default="bench/out", help="folder for the figures")
    args = ap.parse_args(argv)
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    device = device_name()
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    print(f"gpu-check on {device}" + ("" if torch.cuda.is_available() else ": the CUDA parts are skipped"))
    tests = None if args.skip_tests else run_tests(out / f"gpu-check-{slug}-tests.xml", args.tests)
    only = None if args.benches is None else {int(i) for i in args.benches.split(",")}
    figures = [] if args.skip_bench else run_benches(out, slug, only)
    host = None if args.skip_bench else run_host_overhead(out, slug)
    report = markdown(device, tests, figures, host)
    (out / f"gpu-check-{slug}.md").write_text(report + "\n")
    (out / f"gpu-check-{slug}.json").write_text(
        json.dumps(
            {
                "device": device,
                "tests": tests,
                "roofline": roofline_headline(figures),
                "benches": figures,
                "host_overhead": host,
            },
            indent=2,
            default=str,
        )
        + "\n"
    )
    print("\n" + report)
    print(f"wrote {out / f'gpu-check-{slug}.md'}")
    return 0 if tests is None or tests["exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
