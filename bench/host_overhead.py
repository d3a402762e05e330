"""The engine's own host work per step, outside the model's forward, at several batch widths (issue 38).

A Llama whose forward is nearly free (2 layers, hidden 64, 4 heads, the byte-level tokenizer's 259 ids,
so every generated token is also stop-checked as in real use) runs W sequences of short prompts in pure
decode, with delta outputs as the worker asks: with no stop strings, their text made by the worker, not the
engine (`--detokenize engine`: by the engine, as before the worker made it). For each width the bench times a step as
the worker's engine process runs it (`--report deltas`, the default: `engine.step_deltas()` and the
StepReport the process sends, built by workers/engine_process.py's Reporter, not pickled; code from before
step_deltas: `engine.step()`'s outputs through its Reporter; `--report outputs`: `engine.step()` alone)
and, inside it, the model's forward (from a forward pre-hook to its post-hook, the device
synchronized at both ends on CUDA), over `--steps` steady decode steps: host work = step time - forward
time, per step and per sequence, and the same in the engine thread's CPU time (what other processes on
a busy machine inflate less), with the issue's target beside it (<= 1 us a sequence + 100 us a step;
<= 100 us at width 1). On CUDA it also profiles the device (torch.profiler, no host timing in the steps):
its idle time between one step's work and the next's (issue 38's target: <= 200 us).

    python bench/host_overhead.py                          # widths 1, 64, 256
    python bench/host_overhead.py --widths 256 --profile   # cProfile of the last round, by cumulative time
    python bench/host_overhead.py --sections               # and the thread CPU by part of the step
    python bench/host_overhead.py --detokenize engine      # text made in the engine (default: the worker)
    python bench/host_overhead.py --waiting 512 --policy preemptive  # with a backlog that cannot start

`--waiting N`: N more requests, one priority class less urgent, queued behind each width's sequences, with
max_num_seqs set to the width (an engine per width), so none starts: what a backlog in the engine costs every
step (the service's worker holds several times its engine's slots, so its engine nearly always has one).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from transformers import AutoConfig, LlamaForCausalLM  # noqa: E402

from batching import Engine, EngineConfig, SamplingParams  # noqa: E402
from batching.config import SCHEDULING_POLICIES  # noqa: E402
from batching.tokenizer import byte_level_tokenizer  # noqa: E402

BACKLOG_PRIORITY = 6  # --waiting's requests: one class less urgent than the default 5 of the measured ones

NEARLY_FREE = dict(
    vocab_size=259,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def build_model_dir(path: str, text: str = "ascii") -> str:
    """The nearly-free Llama with seeded random weights and the byte-level tokenizer, saved to `path`.

    text "ascii": its head's rows of every id but printable ASCII bytes are zero, so (greedy) it writes
    printable ASCII: whole characters, as a real model's text nearly always is. "bytes": any byte, as random
    weights pick them: half are bytes >= 0x80 that make no character, each token's text waits for the next
    and the detokenizer's window grows (what no real model writes for long)."""
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", **NEARLY_FREE, dtype="float32")
    model = LlamaForCausalLM(config)
    if text == "ascii":
        with torch.no_grad():
            printable = torch.zeros(config.vocab_size, dtype=torch.bool)
            printable[3 + 0x20 : 3 + 0x7F] = True  # byte b is id 3 + b (batching/tokenizer.py)
            model.lm_head.weight[~printable] = 0.0
    model.save_pretrained(path)
    byte_level_tokenizer().save_pretrained(path)
    return path


class ForwardTimer:
    """Sums the wall time of the model's forwards (hooks on the top module)."""

    def __init__(self, model, device):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.total = 0.0
        self.cpu_total = 0.0  # the calling thread's CPU time in forwards
        self._start = self._cpu_start = 0.0
        self._handles = [
            model.register_forward_pre_hook(self._pre),
            model.register_forward_hook(self._post),
        ]

    def _pre(self, *args):
        self.sync()
        self._start = time.perf_counter()
        self._cpu_start = time.thread_time()

    def _post(self, *args):
        self.sync()
        self.total += time.perf_counter() - self._start
        self.cpu_total += time.thread_time() - self._cpu_start

    def close(self):
        for h in self._handles:
            h.remove()


class SectionTimer:
    """The engine thread's CPU time in each named part of a step (`--sections`): wrappers around the engine's
    methods, removed by close(). Nested parts are counted in their parent too (detokenize in stops and text;
    pack in execute, with the forward); each wrapper adds ~1 us a call, so only the parts' sizes count."""

    def __init__(self, engine: Engine):
        from batching import step_deltas

        self.totals: dict[str, float] = {}
        self._undo: list[
            tuple[object, str, object, bool]
        ] = []  # (where, name, what it was, its own attribute)
        runner = engine.runner
        for obj, name, label in (
            (engine.scheduler, "schedule", "schedule"),
            (runner, "execute", "execute (pack + forward)"),
            (runner, "_decode_step", "pack (decodes by columns)"),
            (runner, "step_rows", "pack (rows)"),
            (engine.sampler, "sample", "sample"),
            (engine.stop_checker, "advance", "stops and text"),
            (engine.stop_checker, "detokenize", "detokenize"),
            (step_deltas, "report", "report (step_deltas)"),
            (engine, "stats", "stats"),
        ):
            if hasattr(obj, name):
                self._wrap(obj, name, label)

    def _wrap(self, obj, name: str, label: str) -> None:
        inner = getattr(obj, name)
        totals = self.totals
        totals[label] = 0.0

        def timed(*args, **kwargs):
            started = time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                totals[label] += time.thread_time() - started

        self._undo.append((obj, name, inner, name in vars(obj)))
        setattr(obj, name, timed)

    def per_step(self, steps: int) -> dict[str, float]:
        return {label: round(total / steps * 1e6, 1) for label, total in self.totals.items() if total}

    def close(self) -> None:
        for obj, name, inner, own in reversed(self._undo):
            if own:
                setattr(obj, name, inner)
            else:
                delattr(obj, name)  # the instance's wrapper goes: its class's method shows again


def stepper(engine: Engine, report: str):
    """What one timed step runs (see the module's docstring)."""
    if report == "outputs":
        return engine.step
    from workers.engine_process import Reporter

    class Discard:  # the events pipe, minus the pickling (the same for every version of the report)
        def send(self, message) -> None:
            pass

    reporter = Reporter(Discard())
    if hasattr(engine, "step_deltas"):
        return lambda: reporter.send(engine.step_deltas(), engine.stats())
    return lambda: reporter.send(engine.step(), engine.stats())  # the code before step_deltas


TEXT_IN = "worker"  # --detokenize


def decode_params(max_tokens: int) -> SamplingParams:
    """Greedy deltas, as the worker asks (workers/engine_process.py); with no stop strings the worker makes
    the text (SamplingParams(detokenize=False): the engine makes none), unless --detokenize engine, or this
    engine is older than that switch."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, output_kind="delta")
    if TEXT_IN == "worker" and hasattr(params, "detokenize"):
        params.detokenize = False
    return params


def measure(
    engine: Engine,
    width: int,
    steps: int,
    profile: bool = False,
    report: str = "deltas",
    sections: bool = False,
    waiting: int = 0,
) -> dict:
    """Host work per step of `width` sequences in steady decode, over `steps` steps (median of 3 runs; with
    `sections`, a fourth run's thread CPU by part of the step, not counted in the figures), with `waiting`
    less urgent requests queued behind them (the engine's max_num_seqs is `width` then: none starts)."""
    step = stepper(engine, report)
    # deltas, as the worker asks (workers/engine_process.py)
    params = decode_params(steps * 3 + 64)
    prompts = [[3 + (i * 7 + j) % 250 for j in range(8)] for i in range(width)]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"w{width}-{i}", prompt, params)
    while engine.stats()["num_running"] < width or engine.stats()["num_waiting"]:
        step()
    for i in range(waiting):
        engine.add_request(f"b{width}-{i}", prompts[i % width], params, priority=BACKLOG_PRIORITY)
    for _ in range(8):  # every sequence decoding
        step()
    assert engine.stats()["num_waiting"] == waiting, engine.stats()
    timer = ForwardTimer(engine.model, engine.device)
    rounds = []
    profiler = None
    for r in range(3):
        if profile and r == 2:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        timer.total = timer.cpu_total = 0.0
        started, cpu_started = time.perf_counter(), time.thread_time()
        for _ in range(steps):
            step()
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter() - started, time.thread_time() - cpu_started
        if profiler is not None:
            profiler.disable()
        rounds.append((wall, timer.total, cpu - timer.cpu_total))
    timer.close()
    parts = None
    if sections:
        section_timer = SectionTimer(engine)
        try:
            for _ in range(steps):
                step()
        finally:
            section_timer.close()
        parts = section_timer.per_step(steps)
    for i in range(width):
        engine.abort(f"w{width}-{i}")
    for i in range(waiting):
        engine.abort(f"b{width}-{i}")
    step()
    wall, forward, _ = sorted(rounds, key=lambda r: r[0] - r[1])[1]
    host_cpu_us = sorted(r[2] for r in rounds)[1] / steps * 1e6
    step_us = wall / steps * 1e6
    forward_us = forward / steps * 1e6
    host_us = step_us - forward_us
    target = 100.0 if width == 1 else 100.0 + 1.0 * width
    result = dict(
        width=width,
        waiting=waiting,
        step_us=round(step_us, 1),
        forward_us=round(forward_us, 1),
        host_us_per_step=round(host_us, 1),
        host_us_per_seq=round(host_us / width, 2),
        host_cpu_us_per_step=round(host_cpu_us, 1),
        target_us=target,
        met=host_us <= target,
    )
    if parts is not None:
        result["sections_cpu_us"] = parts
    if profiler is not None:
        import pstats

        pstats.Stats(profiler).sort_stats("cumtime").print_stats(int(os.environ.get("PROFILE_LINES", "45")))
    return result


def device_gaps(engine: Engine, width: int, steps: int) -> dict:
    """CUDA: how long the device sits idle between a step's kernels and the next's, in steady decode at
    `width` with nothing timed from the host (torch.profiler's kernel records): (span - busy) / steps."""
    from torch.profiler import ProfilerActivity, profile

    params = decode_params(steps * 2 + 64)
    for i in range(width):
        engine.add_request(f"g{i}", [3 + (i * 7 + j) % 250 for j in range(8)], params)
    for _ in range(12):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    for i in range(width):
        engine.abort(f"g{i}")
    engine.step()
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    if not spans:
        return dict(width=width, error="no device events recorded")
    busy, end = 0.0, spans[0][0]
    for a, b in spans:  # the union of the kernels' and copies' intervals
        if b > end:
            busy += b - max(a, end)
            end = b
    span = spans[-1][1] - spans[0][0]
    return dict(
        width=width,
        steps=steps,
        device_busy_us_per_step=round(busy / steps, 1),
        device_idle_us_per_step=round((span - busy) / steps, 1),
        target_idle_us=200.0,
    )


def measure_widths(
    widths: list[int],
    steps: int,
    device: str,
    profile: bool = False,
    attention: str = "auto",
    text: str = "ascii",
    report: str = "deltas",
    sections: bool = False,
    waiting: int = 0,
    policy: str | None = None,
) -> dict:
    """The figures for `widths` on `device` (and, on CUDA, the device's idle time between steps)."""
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model_dir(tmp, text)

        def build(max_num_seqs: int) -> Engine:
            config = EngineConfig(
                model=model,
                dtype="float32",
                device=device,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max(512, max(widths)),
                num_device_blocks=max(widths) * 16 + 64,
                attention_backend=attention,
                **({"scheduling_policy": policy} if policy else {}),
            )
            return Engine(config)

        engine = build(max(widths))
        # as the engine process does once its engine is built (workers/process_tuning.py): the heap so far
        # frozen out of the collector's sight, so no full collection walks the model in a timed step
        gc.collect()
        gc.freeze()
        try:
            results = []
            for w in widths:
                if waiting:  # max_num_seqs = the width: the backlog never starts
                    gc.unfreeze()
                    engine = build(w)
                    gc.collect()
                    gc.freeze()
                results.append(measure(engine, w, steps, profile, report, sections, waiting))
            gaps = [device_gaps(engine, w, steps) for w in widths] if engine.device.type == "cuda" else []
        finally:
            gc.unfreeze()
    return dict(
        device=str(engine.device),
        device_name=_device_name(engine.device),
        text=text,
        report=report,
        # where the text was made: this engine's SamplingParams without detokenize (older) makes it itself
        detokenize=TEXT_IN if hasattr(SamplingParams(), "detokenize") else "engine",
        async_scheduling=engine.async_scheduling,
        scheduling_policy=engine.config.scheduling_policy,
        torch=torch.__version__,
        results=results,
        gaps=gaps,
    )


def table(report: dict) -> list[str]:
    lines = [
        f"host work outside the forward: {report['device_name']}, async scheduling "
        f"{'on' if report['async_scheduling'] else 'off'}, torch {report['torch']}, "
        f"{report.get('text', 'bytes')} text made by the {report.get('detokenize', 'engine')}, steps reported "
        f"as {report.get('report', 'outputs')}, scheduling policy {report.get('scheduling_policy', 'predicted')}",
        "",
        "| width | waiting | step us | forward us | host us | host us / seq | host CPU us | target us | met |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['width']} | {r.get('waiting', 0)} | {r['step_us']:.0f} | {r['forward_us']:.0f} | {r['host_us_per_step']:.0f} | "
            f"{r['host_us_per_seq']:.2f} | {r['host_cpu_us_per_step']:.0f} | {r['target_us']:.0f} | "
            f"{'yes' if r['met'] else 'no'} |"
        )
    for r in report["results"]:
        if "sections_cpu_us" in r:
            parts = ", ".join(f"{label} {us:.0f}" for label, us in r["sections_cpu_us"].items())
            lines += [
                "",
                f"width {r['width']}, thread CPU us a step by part (nested parts in their parent): {parts}",
            ]
    if report["gaps"]:
        lines += [
            "",
            "| width | device busy us / step | device idle us / step (target <= 200) |",
            "| --- | --- | --- |",
        ]
        for g in report["gaps"]:
            if "error" in g:
                lines.append(f"| {g['width']} | {g['error']} | |")
            else:
                lines.append(
                    f"| {g['width']} | {g['device_busy_us_per_step']:.0f} | {g['device_idle_us_per_step']:.0f} |"
                )
    return lines


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    return f"{model}, {os.cpu_count()} cores"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", default="1,64,256")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--profile", action="store_true", help="cProfile the last round of each width")
    ap.add_argument(
        "--sections", action="store_true", help="one more round of each width: thread CPU by part of the step"
    )
    ap.add_argument(
        "--attention",
        default="auto",
        help="the engine's attention_backend (triton on the CPU: TRITON_INTERPRET=1, its host work only)",
    )
    ap.add_argument(
        "--text",
        choices=("ascii", "bytes"),
        default="ascii",
        help="what the model writes: printable ASCII (whole characters, as real text) or any byte",
    )
    ap.add_argument(
        "--report",
        choices=("deltas", "outputs"),
        default="deltas",
        help="what a step reports: the engine process's StepReport (deltas) or engine.step()'s outputs",
    )
    ap.add_argument(
        "--detokenize",
        choices=("worker", "engine"),
        default="worker",
        help="where the text is made: in the worker, as it asks for requests without stop strings, or the engine",
    )
    ap.add_argument(
        "--waiting",
        type=int,
        default=0,
        help="requests queued behind each width's, one class less urgent, that never start (a backlog)",
    )
    ap.add_argument(
        "--policy", choices=SCHEDULING_POLICIES, help="the engine's scheduling_policy (default: its own)"
    )
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    global TEXT_IN
    TEXT_IN = args.detokenize
    widths = [int(w) for w in args.widths.split(",")]
    report = measure_widths(
        widths,
        args.steps,
        args.device,
        args.profile,
        args.attention,
        args.text,
        args.report,
        args.sections,
        args.waiting,
        args.policy,
    )
    print("\n".join(table(report)))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
