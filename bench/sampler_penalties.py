"""The batched sampler's penalties, step after step: seconds per step of `Sampler()(logits, seqs)` for rows
with repetition / presence / frequency penalties, this tree's sampler against a baseline sampler read from
git (`--baseline`: a commit whose batching/sampler.py walked every row's tokens on the CPU each step), in
alternating passes of the same process. Each pass runs `--steps` steps over `--rows` sequences of
`--context` tokens, appending each step's tokens as the engine does.

    python bench/sampler_penalties.py --baseline COMMIT --rows 32 128 --context 512 4096

The baseline bench/RESULTS.md used (e4d74bb) is not in this repository's history (squashed into d859f9a),
and no commit here has such a sampler: run it from a clone whose history has one (bench/README.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from batching.sampler import Sampler  # noqa: E402
from batching.sampling_params import SamplingParams  # noqa: E402
from batching.sequence import Sequence  # noqa: E402
from bench.harness import Interference, pct, wait_for_quiet  # noqa: E402


def baseline_sampler(commit: str):
    """The Sampler class of batching/sampler.py at `commit`."""
    shown = subprocess.run(
        ["git", "show", f"{commit}:batching/sampler.py"], cwd=ROOT, capture_output=True, text=True
    )
    if shown.returncode:
        raise SystemExit(f"--baseline {commit}: not in this repository ({shown.stderr.strip()})")
    source = shown.stdout
    path = Path(f"/tmp/genq_baseline_sampler_{commit}.py")
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"baseline_sampler_{commit}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Sampler


def one_pass(sampler, rows: int, context: int, vocab: int, steps: int, seed: int) -> list[float]:
    """Seconds of each step's sampler call (greedy and seeded rows, half each, all penalized)."""
    rng = random.Random(seed)
    seqs = [
        Sequence(
            f"r{i}",
            [rng.randrange(vocab) for _ in range(context // 2)],
            SamplingParams(
                max_tokens=steps + context,
                temperature=0.0 if i % 2 else 1.0,
                repetition_penalty=1.2,
                presence_penalty=0.3,
                frequency_penalty=0.2,
            ),
            5,
            seed + i,
            resume_token_ids=[rng.randrange(vocab) for _ in range(context // 2)],
        )
        for i in range(rows)
    ]
    gen = torch.Generator().manual_seed(seed)
    times = []
    for _ in range(steps):
        logits = torch.randn(rows, vocab, generator=gen)
        t0 = time.perf_counter()
        tokens = sampler(logits, seqs)
        times.append(time.perf_counter() - t0)
        for seq, token in zip(seqs, tokens, strict=True):
            seq.token_ids.append(token)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", required=True, help="the commit whose sampler is the baseline")
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--context", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--pairs", type=int, default=3, help="alternating baseline/new passes per case")
    parser.add_argument("--quiet-wait", type=float, default=60.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    old = baseline_sampler(args.baseline)
    print("| rows | context | baseline ms/step (p50) | this tree ms/step (p50) | ratio | others |")
    print("| --- | --- | --- | --- | --- | --- |")
    for rows in args.rows:
        for context in args.context:
            wait_for_quiet(args.quiet_wait)
            results: dict[str, list[float]] = {"baseline": [], "new": []}
            with Interference() as load:
                for pair in range(args.pairs):
                    for name, make in (("baseline", old), ("new", Sampler)):
                        times = one_pass(make(), rows, context, args.vocab, args.steps, seed=pair)
                        results[name] += times[1:]  # the first step builds the new sampler's rows
            base, new = (pct(results[k], 50) * 1e3 for k in ("baseline", "new"))
            share = f"{load.share:.0%}" if load.share is not None else "?"
            print(f"| {rows} | {context} | {base:.2f} | {new:.2f} | {new / base:.2f} | {share} |")


if __name__ == "__main__":
    main()
