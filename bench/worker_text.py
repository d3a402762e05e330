"""The worker's CPU for making the text of requests without stop strings (issue 38: text off the engine's step).

EngineHost._publish, the worker's reader thread's work for one StepReport, timed on rows as the engine sends
them: W one-token rows a step, with the text from the engine, or (SamplingParams(detokenize=False)) without
it, made here by batching.detokenizer.OutputText. No engine runs: the reports are built here, of printable
ASCII tokens of the built-in byte-level tokenizer. Thread CPU, the median step of `--steps`, three rounds;
metrics are not observed (the same in both).

    python bench/worker_text.py                 # 256 rows a step
    python bench/worker_text.py --width 64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batching import EngineConfig, SamplingParams  # noqa: E402
from batching.detokenizer import Detokenizer, OutputText  # noqa: E402
from batching.tokenizer import load_tokenizer  # noqa: E402
from workers import engine_host  # noqa: E402
from workers.engine_host import EngineHost, EngineRequest  # noqa: E402
from workers.engine_protocol import StepReport  # noqa: E402


def publish_us(host: EngineHost, width: int, steps: int, in_worker: bool) -> float:
    """The median thread CPU of one _publish over `steps` steps of `width` requests."""
    host._detokenize = Detokenizer(load_tokenizer("tiny-llama")) if in_worker else None
    host._requests = {}
    params = SamplingParams(max_tokens=steps + 1)
    for i in range(width):
        request = EngineRequest(f"r{i}", 5)
        request.made_text = OutputText(params) if in_worker else None
        host._requests[request.request_id] = request
    ids = list(host._requests)
    times = []
    for s in range(steps):
        letters = [(i + s) % 26 for i in range(width)]
        tokens = [[3 + 0x61 + c] for c in letters]
        texts = [""] * width if in_worker else [chr(0x61 + c) for c in letters]
        starts = [0 if in_worker else s] * width
        report = StepReport(ids, [s] * width, tokens, starts, texts, [None] * width, None, {}, {}, 0.0)
        t = time.thread_time_ns()
        host._publish(report)
        times.append(time.thread_time_ns() - t)
    return statistics.median(times) / 1000


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args(argv)
    host = EngineHost(EngineConfig(model="tiny-llama"))  # not started: no engine process
    engine_host.metrics.observe_steps = lambda *a: None
    for _ in range(3):
        engine = publish_us(host, args.width, args.steps, False)
        worker = publish_us(host, args.width, args.steps, True)
        print(
            f"a step of {args.width} rows: text from the engine {engine:.0f} us, made in the worker {worker:.0f} us: "
            f"+{(worker - engine) / args.width:.2f} us a token"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
