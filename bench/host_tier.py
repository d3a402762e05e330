"""The prefix cache's host tier: a long shared prefix served from the device pool, from the host pool, or
computed again, measured as the time to first token of the request that reuses it (issue 14).

One engine (bench/engine_throughput.py's Llama config, float32, block size 16, its 512-token budget), a
device pool that holds one long request and little more, and a host pool for the cache's second tier.
Each round, for a `--prefix`-token prefix (default 1,008) and a request B = that prefix + 16 tokens of
its own, 1 new token:

- device: request A (the prefix + other 16 tokens) runs; B follows at once and finds the prefix's blocks
  still on the device;
- host: A runs, then filler requests of fresh tokens take the whole device pool, so A's cached blocks are
  evicted to the host pool (checked: the offload counter grows); B's prefix is copied back from there;
- recompute: A runs, then the cache is emptied (`reset_prefix_cache`); B prefills the whole prefix.

The three are interleaved round by round (`--rounds`, the median counts) so that they meet the same
background load; the share of the CPU other processes took is printed. B's output is checked equal in
all three. On the CPU the "host" and "device" pools are both main memory, so the host-tier figure is
the cost of genq's block copies (gather/scatter of the evicted blocks), not of a PCIe transfer.

    python bench/host_tier.py                 # ~1 min
    python bench/host_tier.py --prefix 496 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without installing

from bench.engine_throughput import BUDGET, build_model_dir  # noqa: E402
from bench.harness import Interference, markdown_table, pct, run_info, write_result  # noqa: E402

VOCAB = 8192
BLOCK = 16
MODES = ("device", "host", "recompute")


def time_to_first_token(engine, request_id: str, prompt: list[int]) -> tuple[float, list[int]]:
    """Seconds from add_request to B's first token, and that token."""
    from batching import SamplingParams

    t0 = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.token_ids:
                seconds = time.perf_counter() - t0
                while engine.has_unfinished_requests():
                    engine.step()
                return seconds, list(out.token_ids)


def run_to_end(engine, prompts: list[list[int]], tag: str) -> None:
    from batching import SamplingParams

    for i, prompt in enumerate(prompts):
        engine.add_request(
            f"{tag}-{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        )
    while engine.has_unfinished_requests():
        engine.step()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix", type=int, default=1008, help="shared prefix in tokens (a multiple of 16)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the three modes; medians reported")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the figures to this file (default bench/out/host_tier.json)")
    args = ap.parse_args(argv)
    if args.prefix % BLOCK:
        ap.error(f"--prefix must be a multiple of the block size ({BLOCK}), got {args.prefix}")

    from batching import Engine, EngineConfig

    run = run_info()
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    rng = random.Random(args.seed)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    request_blocks = args.prefix // BLOCK + 2  # prefix + 16 own tokens + the one new token
    device_blocks = request_blocks + 8
    with tempfile.TemporaryDirectory(prefix="genq-bench-") as model_dir:
        build_model_dir(model_dir, args.seed)
        engine = Engine(
            EngineConfig(
                model=model_dir,
                dtype="float32",
                device=args.device,
                block_size=BLOCK,
                num_device_blocks=device_blocks,
                num_host_blocks=4 * device_blocks,
                max_num_seqs=16,
                max_num_batched_tokens=BUDGET,
                max_model_len=device_blocks * BLOCK,
            )
        )
        bm = engine.block_manager
        run_to_end(engine, [fresh(64)], "warm")
        times: dict[str, list[float]] = {m: [] for m in MODES}
        others: list[float] = []
        outputs: dict[str, set] = {m: set() for m in MODES}
        print(
            f"prefix {args.prefix} tokens + 16 of B's own, {device_blocks} device blocks, "
            f"{4 * device_blocks} host blocks, torch {torch.__version__}, {torch.get_num_threads()} threads"
        )
        for r in range(args.rounds):
            prefix = fresh(args.prefix)  # a new prefix each round: nothing carries over
            b_prompt = prefix + fresh(BLOCK)
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                bm.reset_prefix_cache()
                run_to_end(engine, [prefix + fresh(BLOCK)], f"a{r}{mode}")
                if mode == "host":
                    offloaded = bm.num_offloaded_blocks
                    for k in range(2):  # twice the whole pool in fresh tokens: no block of A's stays
                        run_to_end(engine, [fresh(BLOCK * (device_blocks - 1) - 1)], f"fill{r}{k}")
                    assert bm.num_offloaded_blocks - offloaded >= args.prefix // BLOCK, "prefix not offloaded"
                    host_hits = bm.num_host_hit_tokens
                elif mode == "recompute":
                    bm.reset_prefix_cache()
                hits = bm.num_hit_tokens
                with Interference() as spell:
                    seconds, token = time_to_first_token(engine, f"b{r}{mode}", b_prompt)
                reused = bm.num_hit_tokens - hits
                if mode == "recompute":
                    assert reused == 0, f"recompute reused {reused} tokens"
                else:
                    assert reused >= args.prefix, (
                        f"{mode}: only {reused} of {args.prefix} prefix tokens reused"
                    )
                if mode == "host":
                    host_read = bm.num_host_hit_tokens - host_hits
                    assert host_read >= args.prefix, f"only {host_read} prefix tokens read from the host tier"
                times[mode].append(seconds)
                outputs[mode].add(tuple(token))
                others.append(spell.share or 0.0)
            line = "  ".join(f"{m} {times[m][-1] * 1e3:7.1f} ms" for m in MODES)
            print(f"round {r + 1}: {line}  (others {others[-1]:.0%} of the CPU)")
        if len({frozenset(o) for o in outputs.values()}) != 1:
            sys.exit(f"B's first token differs between modes: {outputs}")
        med = {m: pct(times[m], 50) for m in MODES}
        fig = dict(
            prefix_tokens=args.prefix,
            rounds=args.rounds,
            ttft_ms_median={m: med[m] * 1e3 for m in MODES},
            ttft_ms_all={m: [t * 1e3 for t in times[m]] for m in MODES},
            host_over_recompute=med["host"] / med["recompute"],
            device_over_recompute=med["device"] / med["recompute"],
            others_cpu_share_max=max(others),
            threads=torch.get_num_threads(),
        )
    print(
        f"\nB's time to first token, median of {args.rounds}: device hit {med['device'] * 1e3:.1f} ms, "
        f"host-tier hit {med['host'] * 1e3:.1f} ms, recomputed {med['recompute'] * 1e3:.1f} ms\n"
        f"host-tier hit / recompute = {fig['host_over_recompute']:.1%}, "
        f"device hit / recompute = {fig['device_over_recompute']:.1%}; same first token in all three"
    )
    table = markdown_table(
        ["prefix found", "TTFT median", "/ recompute (the baseline)"],
        [
            ["on the device", f"{med['device'] * 1e3:.1f} ms", f"{fig['device_over_recompute']:.1%}"],
            [
                "on the host tier (copied back)",
                f"{med['host'] * 1e3:.1f} ms",
                f"**{fig['host_over_recompute']:.1%}**",
            ],
            ["nowhere (recomputed)", f"{med['recompute'] * 1e3:.1f} ms", "100%"],
        ],
    )
    write_result("host_tier", fig, table, args.json, run=run)
    return fig


if __name__ == "__main__":
    main()
