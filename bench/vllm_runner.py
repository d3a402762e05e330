"""The vLLM side of bench/engine_throughput.py: runs in vLLM's own virtual environment, in a process of its own.

Started by `engine_throughput.py --vllm-python VENV/bin/python` (not meant to be run by hand). It loads
`LLM(model=DIR, dtype=..., skip_tokenizer_init=True)` on the saved checkpoint, reads the workload
(prompt token ids and max_tokens per request) from a JSON file, runs it once untimed (warm-up: vLLM
compiles the model with torch.compile on the CPU, and its first pass pays for that), then answers
each `run` line on stdin with one timed pass: greedy, `ignore_eos`, `max_tokens` per request, every
request submitted at once through `LLM.generate`. Messages to the parent are single lines on stdout
that start with `MARK` and hold JSON; vLLM's own logs go to stderr.

Nothing here imports genq or torch before vLLM does: this file must run with vLLM's torch alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

MARK = "GENQ-BENCH "


def send(kind: str, **fields) -> None:
    sys.stdout.write(MARK + json.dumps({"kind": kind, **fields}) + "\n")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory (config + safetensors)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--workload", required=True, help='JSON file: [{"prompt": [ids], "max_tokens": n}, ...]')
    ap.add_argument("--engine-args", default="{}", help="JSON of extra LLM(...) keyword arguments")
    args = ap.parse_args()

    # this file's folder (bench/) is first on sys.path: keep its modules from shadowing vLLM's imports
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    from vllm import LLM, SamplingParams, __version__
    from vllm.inputs import TokensPrompt

    reqs = json.loads(open(args.workload).read())
    # a KV cache of a set size: by default vLLM asks for 90% of the machine's memory and refuses to
    # start when other processes hold more than the rest (a shared machine); 2 GiB holds any workload
    # of the bench (the prefill-heavy one takes ~0.5 GiB in float32)
    engine_args = dict(
        model=args.model,
        dtype=args.dtype,
        skip_tokenizer_init=True,
        seed=0,
        kv_cache_memory_bytes=2 << 30,
    )
    engine_args.update(json.loads(args.engine_args))
    llm = LLM(**engine_args)
    prompts = [TokensPrompt(prompt_token_ids=r["prompt"]) for r in reqs]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True, detokenize=False)
        for r in reqs
    ]

    def one_pass() -> tuple[float, list[list[int]]]:
        llm.reset_prefix_cache()  # every pass starts cold, as genq's: the prompts repeat across passes
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        return elapsed, [list(o.outputs[0].token_ids) for o in outs]

    warm_seconds, _ = one_pass()  # untimed: compilation and first-touch of the KV cache
    config = llm.llm_engine.vllm_config
    sched = config.scheduler_config
    send(
        "ready",
        version=__version__,
        warm_up_seconds=warm_seconds,
        pid=os.getpid(),
        config=dict(
            engine_args={k: v for k, v in engine_args.items() if k != "model"},
            max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            block_size=config.cache_config.block_size,
            compilation_mode=str(config.compilation_config.mode),
            compilation_backend=config.compilation_config.backend,
            omp_threads_bind=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
            ld_preload=os.environ.get("LD_PRELOAD", ""),
        ),
    )
    for line in sys.stdin:
        command = line.strip()
        if command == "run":
            elapsed, tokens = one_pass()
            send("pass", seconds=elapsed, tokens=tokens)
        elif command == "quit":
            break
    send("bye")


if __name__ == "__main__":  # vLLM spawns its engine process: nothing may run at import
    main()
