"""genq's whole stack against `vllm serve`, measured by vLLM's own client, `vllm bench serve` (issue 25).

Both serve the same saved model (a seeded random-weight Llama, hidden 512, 8 layers, float32, with genq's
byte-level tokenizer saved beside it and its vocabulary the tokenizer's, so every token has text), one after the other on this machine. The client is
`vllm bench serve --backend openai --endpoint /v1/completions` (streamed), random prompts of 128 +- 64
tokens and 64 +- 32 output tokens, every request sent at once, temperature 0, at each `--concurrency`
(default 64 and 256 prompts). genq runs as deployed: gunicorn (gevent workers), one Celery worker, its
defaults; vLLM's CPU build with its defaults (a 2 GiB KV cache, as bench/engine_throughput.py).

The client runs untouched against both: it sends vLLM's own fields (`repetition_penalty: 1.0`,
`logprobs: null`, `ignore_eos: true` from its random dataset), which genq honours (issue 27), so both
sides generate every requested token.

Printed per concurrency: requests completed, output tok/s, TTFT p50/p99, ITL p50/p99 for both, genq's mean
engine step time (from its worker's metrics), and the targets: genq completes every request, output tok/s
>= vLLM's, TTFT p50 <= vLLM's, ITL p50 <= 1.5x genq's step time, ITL p99 <= vLLM's.

    python bench/serve_vs_vllm.py --vllm-python .vllm-venv/bin/python          # ~10 min on 2 cores
    python bench/serve_vs_vllm.py --vllm-python .vllm-venv/bin/python --concurrency 64 --skip vllm
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing
import requests  # noqa: E402

from bench.harness import run_info, write_result  # noqa: E402
from bench.stack import bench_settings, local_stack, wait_for  # noqa: E402
from tests.conftest import free_port  # noqa: E402


def build_model(path: Path) -> str:
    """The saved model both serve: bench/engine_throughput.py's Llama and genq's tiny-llama tokenizer."""
    if not (path / "config.json").exists():
        from batching.tokenizer import load_tokenizer
        from bench.engine_throughput import build_model_dir

        tokenizer = load_tokenizer("tiny-llama")
        build_model_dir(str(path), seed=0, vocab_size=len(tokenizer))  # every token id has text
        tokenizer.save_pretrained(str(path))
    return str(path)


CLI = str(Path(__file__).resolve().parent / "vllm_cli.py")


def bench_serve(
    python: str, base_url: str, model: str, n: int, out_dir: Path, label: str, key: str = ""
) -> dict:
    """One `vllm bench serve` run (`key`: the API key it sends, as OPENAI_API_KEY); its saved result."""
    name = f"{label}_{n}.json"
    command = [
        python,
        CLI,
        "bench",
        "serve",
        "--backend",
        "openai",
        "--endpoint",
        "/v1/completions",
        "--base-url",
        base_url,
        "--model",
        model,
        "--tokenizer",
        model,
        "--dataset-name",
        "random",
        "--random-input-len",
        "128",
        "--random-output-len",
        "64",
        "--random-range-ratio",
        "0.5",
        "--num-prompts",
        str(n),
        "--request-rate",
        "inf",
        "--temperature",
        "0",
        "--seed",
        "0",
        "--percentile-metrics",
        "ttft,itl",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--result-dir",
        str(out_dir),
        "--result-filename",
        name,
    ]
    log = out_dir / f"{label}_{n}.log"
    with log.open("w") as out:
        env = {**os.environ, "OPENAI_API_KEY": key} if key else None
        subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=True, timeout=1800, env=env)
    return json.loads((out_dir / name).read_text())


def summary(result: dict) -> dict:
    return {
        "completed": result["completed"],
        "num_prompts": result.get("num_prompts", result["completed"] + result.get("failed", 0)),
        "output_tok_s": result["output_throughput"],
        "ttft_p50_ms": result["median_ttft_ms"],
        "ttft_p99_ms": result["p99_ttft_ms"],
        "itl_p50_ms": result["median_itl_ms"],
        "itl_p99_ms": result["p99_itl_ms"],
    }


def vllm_side(python: str, model: str, sizes: list[int], out_dir: Path) -> dict[int, dict]:
    port = free_port()
    log = (out_dir / "vllm_serve.log").open("w")
    server = subprocess.Popen(
        [python, CLI, "serve", model, "--port", str(port), "--dtype", "float32", "--max-model-len", "2048"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={
            **os.environ,
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        },
        start_new_session=True,
    )
    try:
        wait_for(f"http://127.0.0.1:{port}/health", server, out_dir / "vllm_serve.log", 900)
        return {
            n: summary(bench_serve(python, f"http://127.0.0.1:{port}", model, n, out_dir, "vllm"))
            for n in sizes
        }
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)


def genq_side(vllm_python: str, model: str, sizes: list[int], out_dir: Path) -> dict[int, dict]:
    settings = bench_settings(model=model, max_model_len=2048)
    results = {}
    with local_stack(settings, log_dir=out_dir / "genq_logs") as stack:
        for n in sizes:
            before = step_seconds(stack.worker_metrics_url)
            results[n] = summary(bench_serve(vllm_python, stack.url, model, n, out_dir, "genq", stack.key))
            after = step_seconds(stack.worker_metrics_url)
            steps = after[1] - before[1]
            results[n]["engine_step_ms"] = (after[0] - before[0]) / steps * 1000 if steps else None
    return results


def step_seconds(metrics_url: str) -> tuple[float, float]:
    """(sum, count) of the worker's engine step-time histogram."""
    text = requests.get(metrics_url, timeout=10).text

    def value(name: str) -> float:
        match = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
        return float(match.group(1)) if match else 0.0

    return value("genq_engine_step_seconds_sum"), value("genq_engine_step_seconds_count")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", required=True, metavar="PATH", help="python of a venv with vllm-cpu")
    ap.add_argument("--concurrency", default="64,256", help="prompts sent at once, per run")
    ap.add_argument("--skip", default="", help="vllm (then an earlier run's vLLM figures are shown) or genq")
    ap.add_argument("--out", default="bench/out/serve_vs_vllm")
    args = ap.parse_args(argv)
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    run = run_info()
    model = build_model(Path(tempfile.gettempdir()) / "genq-serve-bench-llama")
    sizes = [int(n) for n in args.concurrency.split(",")]
    load = os.getloadavg()[0]
    if "vllm" in args.skip:  # an earlier run's figures, if any
        saved = {n: out_dir / f"vllm_{n}.json" for n in sizes}
        vllm = {n: summary(json.loads(p.read_text())) for n, p in saved.items() if p.exists()}
    else:
        vllm = vllm_side(args.vllm_python, model, sizes, out_dir)
    genq = {} if "genq" in args.skip else genq_side(args.vllm_python, model, sizes, out_dir)
    print(f"load average at start {load:.1f}, at end {os.getloadavg()[0]:.1f}")
    for n in sizes:
        g, v = genq.get(n), vllm.get(n)
        for name, r in (("vLLM", v), ("genq", g)):
            if r:
                print(
                    f"{n:>4} prompts {name:>5}: {r['completed']}/{r['num_prompts']} done, {r['output_tok_s']:.0f} "
                    f"tok/s, TTFT p50 {r['ttft_p50_ms']:.0f} p99 {r['ttft_p99_ms']:.0f} ms, ITL p50 "
                    f"{r['itl_p50_ms']:.0f} p99 {r['itl_p99_ms']:.0f} ms"
                    + (f", engine step {r['engine_step_ms']:.0f} ms" if r.get("engine_step_ms") else "")
                )
        if g and v:
            checks = {
                "all completed": g["completed"] == g["num_prompts"],
                "tok/s >= vLLM": g["output_tok_s"] >= v["output_tok_s"],
                "TTFT p50 <= vLLM": g["ttft_p50_ms"] <= v["ttft_p50_ms"],
                "ITL p50 <= 1.5x step": bool(g.get("engine_step_ms"))
                and g["itl_p50_ms"] <= 1.5 * g["engine_step_ms"],
                "ITL p99 <= vLLM": g["itl_p99_ms"] <= v["itl_p99_ms"],
            }
            print(
                f"{n:>4} prompts targets: "
                + ", ".join(f"{k}: {'met' if ok else 'NOT met'}" for k, ok in checks.items())
            )
    result = {"load_start": load, "vllm": vllm, "genq": genq}
    write_result("serve_vs_vllm", result, path=out_dir / "summary.json", run=run)
    return result


if __name__ == "__main__":
    main()
