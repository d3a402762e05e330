"""The engine: add requests, step them in a continuous batch, report outputs.

    step() = schedule() → run() → postprocess()

Not thread-safe: one thread owns an Engine (see workers.engine_host for the service's use).
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from operator import attrgetter
from typing import TypeVar

import torch

from batching import engine_builder, model_probe, step_cost, step_deltas
from batching.block_manager import blocks_for
from batching.config import EngineConfig
from batching.cuda_graphs import StepGraphs
from batching.grammar import Grammars
from batching.logprobs import token_logprobs
from batching.outputs import RequestOutput
from batching.rank_group import RankGroup
from batching.sampler import Sampler
from batching.sampling_params import SamplingParams
from batching.scheduler import SchedulerOutput
from batching.sequence import FINISH_REASONS, PENDING_TOKEN, Sequence, SequenceStatus
from batching.step_deltas import StepDeltas
from batching.stopping import StopChecker

log = logging.getLogger(__name__)
_Report = TypeVar("_Report")  # what a step returns: its outputs (step) or its columns (step_deltas)


class Engine:
    def __init__(self, config: EngineConfig | None = None):
        self.config = config = config or EngineConfig()
        # tensor parallel: the other ranks, started first (they load beside this one); stopped by close()
        self.ranks = RankGroup.start(config) if config.tensor_parallel_size > 1 else None
        try:
            self._build(config)
        except BaseException:
            self.close()
            raise

    def _build(self, config: EngineConfig) -> None:
        collectives = self.ranks.collectives if self.ranks is not None else None
        loaded = engine_builder.load(config, collectives)
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.device, self.dtype = loaded.device, loaded.dtype
        self.vocab_size, self.max_model_len = loaded.vocab_size, loaded.max_model_len
        self.eos_token_ids = loaded.eos_token_ids
        self.attention_backend, kernel = engine_builder.choose_attention(config, self.device, self.dtype)
        parts = engine_builder.build(config, loaded, self.attention_backend, kernel, collectives)
        self.kv_cache, self.state_cache = parts.kv_cache, parts.state_cache
        self.block_manager, self.scheduler, self.runner = parts.block_manager, parts.scheduler, parts.runner
        self.runner.followers = self.ranks
        self.activation_bytes = parts.activation_bytes
        # prices the budget from the steps' own times; None while warming up, and with plain token budgets
        self.step_costs: step_cost.StepCostModel | None = None
        self.sampler = Sampler(self.eos_token_ids)
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.stop_checker = StopChecker(self.tokenizer, self.eos_token_ids)

        self.requests: dict[str, Sequence] = {}
        self._aborted: list[Sequence] = []  # aborted between steps, reported by the next
        self._report_memo = step_deltas.ReportMemo()  # the last report's steady rows (step_deltas.py)
        self._overlappable_seqs: list[Sequence] = []  # the last sampled rows when all were overlappable
        # async scheduling: the step whose tokens are still on their way to the host (step())
        # (not with tensor-parallel ranks: they take each step's input tokens from the host)
        default_async = self.device.type == "cuda" and self.ranks is None
        self.async_scheduling = (
            config.async_scheduling if config.async_scheduling is not None else default_async
        )
        self._inflight: _Launched | None = None
        self._ids = itertools.count()
        self._seed_rng = random.Random(config.seed)
        self._counters = dict(
            num_steps=0,
            num_prompt_tokens_computed=0,
            num_generated_tokens=0,
            num_aborted=0,
            step_time_s=0.0,
            last_step_num_tokens=0,
            last_step_budget_used=0,
            last_step_num_seqs=0,
            last_step_time_s=0.0,
            num_overlapped_steps=0,  # steps whose tokens reached the host while the next one ran
        )
        self._warm_up()
        self.runner.graphs = engine_builder.capture_graphs(config, loaded, self.attention_backend, parts)
        if self.scheduler.cost_aware:
            self.step_costs = step_cost.StepCostModel()
        log.info(
            "engine ready: %s on %s%s/%s, %s attention%s, %d device + %d host KV blocks of %d tokens, "
            "max_model_len %d",
            config.model,
            self.device,
            f" and {config.tensor_parallel_size - 1} more ranks" if self.ranks is not None else "",
            str(self.dtype).removeprefix("torch."),
            self.attention_backend,
            (
                f", CUDA graphs for {len(self.graphs.graphs)} decode widths and "
                f"{len(self.graphs.mixed)} token counts of mixed steps"
            )
            if self.graphs
            else "",
            parts.num_device_blocks,
            parts.num_host_blocks,
            config.block_size,
            self.max_model_len,
        )

    @property
    def graphs(self) -> StepGraphs | None:
        """The captured graphs the runner replays (None: every step runs eagerly)."""
        graphs = self.runner.graphs
        return graphs if isinstance(graphs, StepGraphs) else None

    # --- requests ---------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 5,
        resume_token_ids: list[int] | None = None,
        arrival_time: float | None = None,
        *,
        predicted_output_tokens: int | None = None,
        deadline: float | None = None,
    ) -> None:
        """Queue a request. Raises ValueError naming the field and the limit; nothing is queued then.

        resume_token_ids: tokens this request already generated (e.g. persisted before a crash); they
        are prefilled with the prompt, count toward max_tokens, and sampling continues at their index.
        arrival_time: when it arrived (seconds since the epoch; None: now): its place among equals.
        predicted_output_tokens: the output it is expected to reach (None: max_tokens), and deadline: when
        it is wanted (seconds since the epoch; None: none): its place within its priority class under
        scheduling_policy "predicted" (admission_order.py). Neither changes what it generates.
        """
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 9:
            raise ValueError(f"priority must be an integer from 0 (most urgent) to 9, got {priority!r}")
        if predicted_output_tokens is not None and (
            isinstance(predicted_output_tokens, bool)
            or not isinstance(predicted_output_tokens, int)
            or predicted_output_tokens < 0
        ):
            raise ValueError(
                f"predicted_output_tokens must be an integer >= 0 or None, got {predicted_output_tokens!r}"
            )
        if deadline is not None and (
            isinstance(deadline, bool)
            or not isinstance(deadline, (int, float))
            or not math.isfinite(deadline)
        ):
            raise ValueError(
                f"deadline must be seconds since the epoch (a finite number) or None, got {deadline!r}"
            )
        prompt_ids = self._encode_prompt(prompt)
        resumed = self._check_token_ids("resume_token_ids", resume_token_ids or [])
        self._check_token_ids("logit_bias", list(params.logit_bias))
        if len(resumed) >= params.max_tokens:
            raise ValueError(
                f"resume_token_ids: {len(resumed)} tokens already reach max_tokens "
                f"({params.max_tokens}); the request is complete"
            )
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds max_model_len ({self.max_model_len})"
            )
        # the last token is never fed back, so it needs no KV slot
        if blocks_for(total - 1, self.config.block_size) > self.block_manager.num_device_blocks:
            raise ValueError(
                f"prompt + max_tokens ({total} tokens) needs more KV blocks than the device pool "
                f"holds ({self.block_manager.num_device_blocks} blocks of {self.config.block_size})"
            )
        grammar = (
            self.grammars.matcher(params.json_schema, resumed) if params.json_schema is not None else None
        )
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        seq = Sequence(
            request_id,
            prompt_ids,
            params,
            priority,
            seed,
            resumed,
            arrival_time,
            self.max_model_len,
            predicted_output_tokens,
            None if deadline is None else float(deadline),
        )
        seq.grammar = grammar
        seq.stop_ids = self.stop_checker.stop_ids(params)
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Cancel a request wherever it is; its blocks are free at once. False if it is unknown/finished."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        if seq.pending_row >= 0:  # its token in flight is dropped, never delivered
            seq.token_ids.pop()
            seq.pending_row = -1
        self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        self.sampler.forget(seq)
        seq.finish_time = time.time()
        self._counters["num_aborted"] += 1
        self._aborted.append(seq)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._aborted) or self._inflight is not None

    # --- the step ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; returns the outputs of requests that changed (new tokens, finished, aborted)."""
        return self._step(self._outputs)

    def step_deltas(self) -> StepDeltas:
        """Run one batch; returns what the requests that changed add, by columns (step_deltas.py): every request
        is reported as its delta, whatever its output_kind, and no object is made per request."""
        return self._step(self._report)

    def _report(self, changed: list[Sequence]) -> StepDeltas:
        """`step_deltas.report` of `changed`, with the engine's memo of the last report (its steady rows)."""
        return step_deltas.report(changed, self._report_memo, self.scheduler.version)

    def _step(self, report: Callable[[list[Sequence]], _Report]) -> _Report:
        """Run one batch; returns `report` of the sequences that changed (new tokens, finished, aborted), in
        order, made before a step left in flight puts its placeholders in their tokens.

        With async scheduling the step launches its batch, then finishes the last step's (its tokens come
        to the host while this one runs), so its outputs are the last step's: schedule → run → postprocess,
        with the postprocess one step behind. A step whose tokens the next needs on the host (a grammar,
        penalties, log probabilities) is finished at once."""
        started = time.perf_counter()
        prev, self._inflight = self._inflight, None
        sched = self.scheduler.schedule()
        cost_model = self.step_costs if sched.seqs else None  # it learns from steps that ran a batch
        make_up = (
            step_cost.features(
                sched.seqs, sched.num_scheduled_tokens, sched.num_decodes, sched.decode_context
            )
            if cost_model
            else None
        )
        try:
            launched = self._launch(sched, prev)
        except BaseException:
            self.scheduler.forget_steady()  # its sequences did not advance as scheduled
            raise
        changed, self._aborted = self._aborted, []
        if prev is not None:
            changed += self._finish(prev)
        hold = launched is not None and self.async_scheduling and launched.overlappable
        if launched is not None and not hold:  # (prev's finish may have ended some of its sequences)
            changed += self._finish(launched, settled=prev is None)
        reported = report(changed)
        if hold:
            assert launched is not None
            self._hold(launched)
        seconds = time.perf_counter() - started
        self._record_step(sched, seconds)
        if cost_model and make_up is not None and (costs := cost_model.record(make_up, seconds)) is not None:
            log.log(
                logging.INFO if cost_model.num_fits == 1 else logging.DEBUG,
                "step costs fitted on the last steps: %s",
                costs,
            )
            self.scheduler.set_costs(costs)
        return reported

    def _launch(self, sched: SchedulerOutput, prev: _Launched | None) -> _Launched | None:
        """Run the step's forward and sample its tokens, which stay on the device (their copy to the host
        started); the scheduled sequences advance. None if nothing was sampled."""
        pending = prev.tokens if prev is not None else None
        logits, sample_seqs, prompt_logits, spans = self.runner.execute(sched, pending)
        prompt_tokens, decodes = 0, sched.num_decodes
        for seq in sched.seqs[:decodes]:  # the step's decodes come first: a token each
            seq.num_computed_tokens += 1
        for seq, n in zip(sched.seqs[decodes:], sched.num_scheduled_tokens[decodes:], strict=True):
            if (
                seq.num_computed_tokens < len(seq.token_ids) - 1
                or len(seq.token_ids) == seq.num_prompt_tokens
            ):
                prompt_tokens += n  # a prompt's (or resumed tokens') chunk, not a decode
            seq.num_computed_tokens += n
        self._counters["num_prompt_tokens_computed"] += prompt_tokens
        if logits is None or not sample_seqs:
            if prompt_logits is not None:
                self._record_prompt_logprobs(prompt_logits, spans)
            return None
        tokens = self.sampler.sample(logits, sample_seqs)
        self.runner.sampled(tokens)
        if sample_seqs != self._overlappable_seqs:  # (the steady step's are the last step's)
            self._overlappable_seqs = list(sample_seqs) if all(map(_overlappable, sample_seqs)) else []
        overlappable = prompt_logits is None and bool(self._overlappable_seqs)
        return _Launched(sample_seqs, tokens, _to_host(tokens), logits, prompt_logits, spans, overlappable)

    def _hold(self, launched: _Launched) -> None:
        """Leave `launched` in flight: its sequences' tokens wait on the device, placeholders on the host,
        and the next step is scheduled meanwhile (its inputs read them on the device)."""
        launched.logits = None
        ended = SequenceStatus.FINISHED_STOPPED
        for i, seq in enumerate(launched.seqs):
            if seq.status < ended:  # (one that the last step ended runs moot)
                seq.token_ids.append(PENDING_TOKEN)
                seq.pending_row = i
        self._inflight = launched
        self._counters["num_overlapped_steps"] += 1

    def _finish(self, launched: _Launched, settled: bool = False) -> list[Sequence]:
        """The host's part of a launched step, once its tokens are there: log probabilities, the tokens
        appended, stops; returns the sequences that changed. A sequence that ended meanwhile (a stop, a
        cancel) drops its token. `settled`: none can have ended since the launch (finished in the step that
        launched it, nothing finished before it)."""
        tokens = launched.host_tokens()
        seqs = launched.seqs
        if launched.prompt_logits is not None:
            self._record_prompt_logprobs(launched.prompt_logits, launched.spans)
        # (an overlappable step asked for no log probabilities)
        if (
            launched.logits is not None
            and not launched.overlappable
            and any(s.params.logprobs is not None for s in seqs)
        ):
            self._record_logprobs(launched.logits, seqs, tokens)
        if not settled:
            ended = SequenceStatus.FINISHED_STOPPED
            live = [i for i, seq in enumerate(seqs) if seq.status < ended]
            if len(live) < len(seqs):
                seqs, tokens = [seqs[i] for i in live], [tokens[i] for i in live]
        return self._postprocess(seqs, tokens)

    def _postprocess(self, sample_seqs: list[Sequence], tokens: list[int]) -> list[Sequence]:
        """Each sequence gets its token (stop_checker.advance); those that ended leave. All of them changed."""
        self._counters["num_generated_tokens"] += len(tokens)
        now = time.time()
        ended, with_grammar = self.stop_checker.advance(sample_seqs, tokens, now)
        for i in with_grammar:
            grammar = sample_seqs[i].grammar
            assert grammar is not None
            if grammar.consume_token(tokens[i]) and grammar.is_stopped():
                ended[i] = SequenceStatus.FINISHED_STOPPED  # its JSON is complete
        for i, status in ended.items():
            seq = sample_seqs[i]
            self.scheduler.finish(seq, status)
            self.sampler.forget(seq)
            seq.finish_time = now
            del self.requests[seq.req_id]
        return sample_seqs

    @staticmethod
    def _record_prompt_logprobs(logits: torch.Tensor, spans: list[tuple[Sequence, int, int]]) -> None:
        """Keep the log probabilities of the tokens after the positions of `spans` (logits: [P, V], theirs in
        order): a prompt's tokens', or a resumed request's output tokens'."""
        next_ids: list[int] = []
        top: list[int] = []
        where: list[list] = []
        for seq, first, n in spans:
            for q in range(first, first + n):
                prompt = q + 1 < seq.num_prompt_tokens
                next_ids.append(seq.token_ids[q + 1])
                top.append((seq.params.prompt_logprobs if prompt else seq.params.logprobs) or 0)
                where.append(seq.prompt_logprobs if prompt else seq.logprobs)
        for kept, logprob in zip(where, token_logprobs(logits, next_ids, top), strict=True):
            kept.append(logprob)

    @staticmethod
    def _record_logprobs(logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> None:
        """Keep the sampled tokens' log probabilities, for the requests that asked (logits: [N, V])."""
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        index = torch.tensor(rows, device=logits.device)
        found = token_logprobs(
            logits[index], [tokens[i] for i in rows], [seqs[i].params.logprobs or 0 for i in rows]
        )
        for i, logprob in zip(rows, found, strict=True):
            seqs[i].logprobs.append(logprob)

    def _outputs(self, changed: list[Sequence]) -> list[RequestOutput]:
        """A RequestOutput per changed sequence: its delta (from step_deltas.report's columns, the same rows
        `step_deltas()` gives) with output_kind "delta", else all it has."""
        deltas = self._report([s for s in changed if s.params.output_kind == "delta"])
        outputs = []
        row = 0
        for seq in changed:
            if seq.params.output_kind != "delta":
                outputs.append(self._output(seq))
                continue
            reason = deltas.finish_reasons[row]
            first = deltas.token_starts[row] == 0 and deltas.text_starts[row] == 0  # its first output
            p = seq.params
            outputs.append(
                _new_output(  # RequestOutput(...), built in C: one per request per step
                    RequestOutput,
                    (
                        seq.req_id,
                        seq.token_ids[: seq.num_prompt_tokens] if first else [],
                        deltas.token_ids[row],
                        deltas.texts[row],
                        reason is not None,
                        reason,
                        seq.num_preemptions,
                        seq.arrival_time,
                        seq.first_token_time,
                        seq.finish_time,
                        seq.priority,
                        deltas.logprobs[row] if deltas.logprobs is not None else None,
                        list(seq.prompt_logprobs) if p.prompt_logprobs is not None and first else None,
                    ),
                )
            )
            row += 1
        return outputs

    def _output(self, seq: Sequence) -> RequestOutput:
        """All a request has so far (output_kind "cumulative")."""
        return RequestOutput(
            request_id=seq.req_id,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            token_ids=seq.output_token_ids,
            text=seq.text,
            finished=seq.finished,
            finish_reason=FINISH_REASONS.get(seq.status),
            num_preemptions=seq.num_preemptions,
            arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time,
            finish_time=seq.finish_time,
            priority=seq.priority,
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
            prompt_logprobs=list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None else None,
        )

    # --- offline use ------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Seq[str | list[int]],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        priorities: Seq[int] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in the order of `prompts`."""
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        priorities = list(priorities) if priorities is not None else [5] * len(prompts)
        if not len(prompts) == len(params) == len(priorities):
            raise ValueError("prompts, params and priorities must have the same length")
        batch = next(self._ids)
        ids = [f"generate-{batch}-{i}" for i in range(len(prompts))]
        added = []
        try:
            for rid, prompt, p, prio in zip(ids, prompts, params, priorities, strict=True):
                self.add_request(rid, prompt, p, prio)
                added.append(rid)
        except ValueError:
            for rid in added:
                self.abort(rid)
            self._aborted = [s for s in self._aborted if s.req_id not in added]
            raise
        results: dict[str, RequestOutput] = {}
        bar = _progress(len(ids), use_tqdm)
        while len(results) < len(ids):
            for out in self.step():
                if out.finished and out.request_id in ids:
                    results[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [results[rid] for rid in ids]

    # --- introspection ----------------------------------------------------------------------------

    def stats(self) -> dict:
        bm, sch, graphs = self.block_manager, self.scheduler, self.graphs
        return {
            "num_running": len(sch.running),
            "num_waiting": len(sch.waiting),
            "num_swapped": len(sch.swapped),
            "num_device_blocks": bm.num_device_blocks,
            "num_free_device_blocks": bm.num_free_device_blocks,
            "num_host_blocks": bm.num_host_blocks,
            "num_free_host_blocks": bm.num_free_host_blocks,
            "device_kv_usage": bm.device_usage(),
            "host_kv_usage": bm.host_usage(),
            "num_preemptions": sch.num_preemptions,
            "num_blocks_swapped_out": sch.num_blocks_swapped_out,
            "num_blocks_swapped_in": sch.num_blocks_swapped_in,
            "num_recomputed_tokens": sch.num_recomputed_tokens,
            # prefix caching: of the tokens of sequences that started from scratch, those whose KV was
            # reused; device blocks holding cached KV (referenced or free); cached blocks evicted
            "prefix_cache_hit_rate": bm.hit_rate,
            "num_prefix_cache_queried_tokens": bm.num_queried_tokens,
            "num_prefix_cache_hit_tokens": bm.num_hit_tokens,
            "num_cached_device_blocks": bm.num_cached_device_blocks,
            "num_prefix_cache_evictions": bm.num_evictions,
            # the host tier: evicted blocks kept in the host pool, and hit tokens copied back from it
            "num_cached_host_blocks": bm.num_cached_host_blocks,
            "num_prefix_cache_offloaded_blocks": bm.num_offloaded_blocks,
            "num_prefix_cache_host_hit_tokens": bm.num_host_hit_tokens,
            # CUDA: steps that replayed a captured graph of the forward (cuda_graphs.py)
            "num_graph_steps": graphs.num_replays if graphs else 0,
            # of those, steps with prefill chunks (mixed graphs by token count)
            "num_mixed_graph_steps": graphs.num_mixed_replays if graphs else 0,
            **self._counters,
        }

    def close(self) -> None:
        """Stop the engine's other ranks (tensor parallel; done too when the engine is collected). Nothing else
        needs closing: with one rank this does nothing. The engine cannot step after."""
        if self.ranks is not None:
            self.ranks.close()

    def check_invariants(self) -> None:
        """Assert the block manager's invariants (for tests)."""
        self.block_manager.check_invariants(self.scheduler.live_sequences())

    # --- helpers ----------------------------------------------------------------------------------

    def _encode_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt: {self.config.model!r} has no tokenizer; pass token ids")
            if not prompt:
                raise ValueError("prompt must not be empty")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = self._check_token_ids("prompt", prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        return ids

    def _check_token_ids(self, field: str, ids) -> list[int]:
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"{field} must be a string or a list of token ids")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"{field}: token id {t!r} is outside the vocabulary [0, {self.vocab_size})")
        return list(ids)

    def _record_step(self, sched: SchedulerOutput, seconds: float) -> None:
        c = self._counters
        c["num_steps"] += 1
        c["step_time_s"] += seconds
        c["last_step_num_tokens"] = sched.total_num_scheduled_tokens
        c["last_step_budget_used"] = self.scheduler.last_budget_used  # tokens, priced (step_cost.py)
        c["last_step_num_seqs"] = len(sched.seqs)
        c["last_step_time_s"] = seconds

    def _warm_up(self) -> None:
        """Probe requests through the real path: proves the model runs exactly on paged attention."""
        model_probe.verify(self)
        for key in self._counters:
            self._counters[key] = 0 if isinstance(self._counters[key], int) else 0.0
        self.block_manager.reset_prefix_cache()  # the warm-up's KV is nobody's prefix


@dataclass(slots=True)
class _Launched:
    """A step whose forward and sampling were launched: its sampled sequences, their tokens on the device
    and on their way to the host, and what its finish needs (logits only when it is finished at once)."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # [N] on the device: the next step's inputs read them there
    host: tuple[torch.Tensor, torch.cuda.Event | None]  # the step's one device-to-host copy, and its event
    logits: torch.Tensor | None
    prompt_logits: torch.Tensor | None
    spans: list
    overlappable: bool  # nothing the next step computes needs its tokens on the host

    def host_tokens(self) -> list[int]:
        """The tokens as a list, once their copy has arrived (waits for it, and only for it)."""
        tokens, event = self.host
        if event is not None:
            event.synchronize()
        return tokens.tolist()


_new_output = tuple.__new__
_overlappable = attrgetter("overlappable")


def _to_host(tokens: torch.Tensor):
    """Start the copy of a step's sampled tokens to (pinned) host memory: (host tensor, its CUDA event)."""
    if not tokens.is_cuda:  # (cheaper than making its device)
        return tokens, None
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


def _progress(total: int, enabled: bool):
    if enabled:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="generate", unit="req")
    return _NoBar()


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


__all__ = ["Engine"]
