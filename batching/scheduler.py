"""Decides what each engine step runs: token budget, priorities, preemption. No torch here.

A step is filled in stall-free order (Sarathi-Serve): one decode token for every running sequence,
then, priority class by priority class (0 first), the next chunks of that class's prefills in
progress, then its sequences that are not running (swapped out or waiting) by arrival. A step carries
the prefill chunks of one class only, the most urgent that can run: an urgent request's prefill runs
in a short step (decodes + its chunk), not one padded with less urgent prompts, so its first token
comes sooner; the budget left over waits one step. Before
filling, `_make_room_for_urgent` preempts running sequences that are strictly less urgent than one
that cannot otherwise start (swapped, waiting) or take its next prefill chunk. Admissions never skip
ahead: none starts behind a more urgent sequence that cannot, or behind one preempted in this step.

The budget is priced, not counted (with `attention_aware_chunks`): a chunk pays for its attention and
its context, a decode for its row work and its context, at `StepCosts` prices that the engine fits on
its own step times (step_cost.py); until then a chunk pays for its attention only and a decode 1.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from batching.block_manager import BlockManager, blocks_for
from batching.config import EngineConfig
from batching.sequence import Sequence, SequenceStatus
from batching.step_cost import StepCosts


@dataclass(slots=True)
class SchedulerOutput:
    """What the model runner executes this step. Plain data: sequences, token counts, block copies."""

    seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    preempted: list[Sequence] = field(default_factory=list)

    def add(self, seq: Sequence, num_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_scheduled_tokens.append(num_tokens)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)


class Scheduler:
    def __init__(
        self, config: EngineConfig, block_manager: BlockManager, context_per_token: float | None = None
    ):
        """`context_per_token`: how many tokens of context one token's attention must span to cost as much
        as the rest of its forward pass (the model's linear layers); see `_chunk`. None: chunks cost their
        token count only. `set_costs` replaces it with prices fitted on real steps (step_cost.py)."""
        self.cost_aware = config.attention_aware_chunks
        self.costs = StepCosts(context_per_token=context_per_token if self.cost_aware else None)
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.chunked_prefill = config.enable_chunked_prefill
        self.swap_enabled = config.preemption_mode == "swap"
        self.block_manager = block_manager
        self.last_budget_used = 0  # of the last schedule(): decodes' charge + chunks' costs
        # keep free a few blocks when admitting without preemption, so running decodes can grow
        self.watermark_blocks = max(1, block_manager.num_device_blocks // 100)
        self.waiting: list[Sequence] = []  # sorted by urgency
        self.swapped: list[Sequence] = []  # sorted by urgency
        self.running: list[Sequence] = []
        # counters
        self.num_preemptions = 0
        self.num_blocks_swapped_out = 0
        self.num_blocks_swapped_in = 0
        self.num_recomputed_tokens = 0

    # --- queue management -------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=_urgency)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.swapped or self.running)

    def live_sequences(self) -> list[Sequence]:
        return self.running + self.swapped + self.waiting

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Take `seq` out of whichever queue holds it and free its blocks."""
        queue = {
            SequenceStatus.RUNNING: self.running,
            SequenceStatus.SWAPPED: self.swapped,
            SequenceStatus.WAITING: self.waiting,
        }.get(seq.status)
        if queue is not None:
            queue.remove(seq)
        self.block_manager.free(seq)
        seq.status = status

    # --- one step ---------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        for seq in self.running:  # the last step computed their KV: full blocks join the prefix cache
            self.block_manager.cache_computed_blocks(seq)
        self._make_room_for_urgent(out)
        budget = self._schedule_decodes(out)
        self.last_budget_used = self.max_num_batched_tokens - self._schedule_prefills(out, budget)
        return out

    def set_costs(self, costs: StepCosts) -> None:
        """Prices fitted on the engine's steps (step_cost.StepCostModel); ignored with cost-aware
        budgets off (`attention_aware_chunks=False`: plain token counts)."""
        if self.cost_aware:
            self.costs = costs

    @property
    def context_per_token(self) -> float | None:
        return self.costs.context_per_token

    def _decode_cost(self, seq: Sequence) -> float:
        """A decode's share of the budget: its token and row work, plus reading its context."""
        c = self.costs.decode_context_per_token
        return self.costs.decode_tokens + (seq.num_computed_tokens / c if c else 0.0)

    def _prefill_budget(self, num_decodes: int, decode_cost: float) -> int:
        """What the decodes leave of the budget for prefill chunks. Priced decodes take at most half
        the budget (beyond that, many long contexts): prefills keep the other half, so admissions,
        urgent ones first, never wait for decodes to finish."""
        charge = max(num_decodes, min(round(decode_cost), self.max_num_batched_tokens // 2))
        return self.max_num_batched_tokens - charge

    def _schedule_decodes(self, out: SchedulerOutput) -> int:
        """A token for every running decode (up to the budget in tokens); returns the prefill budget."""
        bm = self.block_manager
        tokens, cost = 0, 0.0
        for seq in sorted((s for s in self.running if s.is_decoding), key=_urgency):
            if tokens == self.max_num_batched_tokens:
                break
            if seq.status != SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            while not bm.can_allocate(seq, 1):
                victim = self._least_urgent_running(exclude=out.seqs)
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status == SequenceStatus.RUNNING:
                bm.allocate(seq, 1)
                out.add(seq, 1)
                tokens += 1
                cost += self._decode_cost(seq)
        return self._prefill_budget(tokens, cost)

    def _prefill_order(self) -> list[Sequence]:
        """Who gets the budget left after decodes: by priority; within a priority, prefills in progress
        first (stall-free), then swapped and waiting sequences by arrival. A less urgent prefill in
        progress therefore never holds back a more urgent request (its blocks stay; it only waits)."""
        prefilling = [s for s in self.running if not s.is_decoding]
        return sorted(prefilling + self.swapped + self.waiting, key=_prefill_key)

    def _schedule_prefills(self, out: SchedulerOutput, budget: int) -> int:
        """Chunks of one priority class within `budget`; returns the budget left."""
        admitting = True
        prefill_priority = None  # the class whose chunks this step carries: one class a step
        for seq in self._prefill_order():
            if budget <= 0:
                return budget
            if seq in out.preempted:  # no ping-pong within one step
                continue
            if prefill_priority is not None and seq.priority > prefill_priority:
                return budget  # an urgent prefill runs in a short step: no less urgent chunk rides along
            if seq.status == SequenceStatus.RUNNING:
                taken = self._schedule_chunk(seq, out, budget)
                budget -= taken
                if taken:
                    prefill_priority = seq.priority
            elif admitting:
                if any(_urgency(v) < _urgency(seq) for v in out.preempted):
                    # a sequence preempted in this step keeps its place: nobody behind it starts
                    # in the room it left
                    admitting = False
                    continue
                n = self._admit(seq, out, budget)
                # strict order: nobody starts ahead of the most urgent sequence that cannot start
                admitting = n > 0
                budget -= n
                if n:
                    prefill_priority = seq.priority
        return budget

    def _schedule_chunk(self, seq: Sequence, out: SchedulerOutput, budget: int) -> int:
        """The next chunk of a prefill in progress; returns the budget it took."""
        bm = self.block_manager
        n = min(self._chunk(seq, budget), bm.max_tokens_allocatable(seq))
        if n == 0:
            # pool exhausted: a prefill that cannot move while others hold all blocks would
            # deadlock, so the least urgent unscheduled running sequence (maybe this one) yields
            victim = self._least_urgent_running(exclude=out.seqs)
            self._preempt(victim, out)
            if victim is seq:
                return 0
            n = min(self._chunk(seq, budget), bm.max_tokens_allocatable(seq))
            if n == 0:
                return 0
        bm.allocate(seq, n)
        out.add(seq, n)
        return self._chunk_cost(seq, n, budget)

    def _chunk(self, seq: Sequence, budget: int, start: int | None = None) -> int:
        """Tokens of `seq`'s next prefill chunk within `budget` (the budget they take: `_chunk_cost`).

        A prefill token costs its share of the linear layers plus attention over everything before
        it, and late in a long prompt the attention dominates: a budget of plain tokens makes those
        chunks run far longer than early ones (the slowest steps set the time between tokens of every
        decode in the batch). With `context_per_token` = C, a chunk of n tokens starting at position s
        costs n * (1 + (s + n/2) / C) token-equivalents, plus s / C_ctx for gathering its context once
        the engine has fitted that price (`StepCosts`): the budget buys steps of even duration.
        At least one token always fits, so a prefill never stalls. `start`: where the chunk begins if
        not at the computed tokens (a sequence about to start on a cached prefix)."""
        start = seq.num_computed_tokens if start is None else start
        n = min(seq.num_tokens - start, budget)
        if not self.cost_aware or n <= 1:
            return n
        c = self.context_per_token
        room = budget - self._context_cost(start) + 0.5  # as _chunk_cost rounds
        if c is None:
            fits = int(room)
        else:
            # largest n with n^2 / (2C) + n (1 + start / C) <= room
            b = 1 + start / c
            fits = int((math.sqrt(b * b + 2 * max(0.0, room) / c) - b) * c)
        return max(1, min(n, fits))

    def _context_cost(self, start: int) -> float:
        """What a chunk starting at `start` pays for the context it attends over, whatever its own
        length (gathering it)."""
        c = self.costs.chunk_context_per_token
        return start / c if c else 0.0

    def _chunk_cost(self, seq: Sequence, n: int, budget: int) -> int:
        """The budget taken by `n` prefill tokens of `seq` starting at its computed position (see `_chunk`)."""
        if not self.cost_aware:
            return n
        start, c = seq.num_computed_tokens, self.context_per_token  # advanced only after the step runs
        attention = n * (start + n / 2) / c if c else 0.0
        return min(budget, max(n, round(n + attention + self._context_cost(start))))

    def _admit(self, seq: Sequence, out: SchedulerOutput, budget: int) -> int:
        """Swap in or start a not-running sequence with its first chunk; returns the budget it took (0: cannot).

        A sequence that starts from scratch begins after the longest prefix of its tokens whose KV is
        cached (block_manager.py) and computes only the rest."""
        bm = self.block_manager
        if len(self.running) >= self.max_num_seqs:
            return 0
        hit = self._usable_cached_prefix(seq, out) if seq.status == SequenceStatus.WAITING else []
        start = seq.num_computed_tokens + len(hit) * bm.block_size
        first_prefill = all(k == 1 for k in out.num_scheduled_tokens)
        n = self._first_chunk(seq.num_tokens - start, budget, first_prefill)
        if n == 0:
            return 0
        if self.chunked_prefill:
            n = min(n, self._chunk(seq, budget, start))
        if seq.status == SequenceStatus.SWAPPED:
            extra = blocks_for(seq.num_computed_tokens + n, bm.block_size) - len(seq.host_block_table)
            if not bm.can_swap_in(seq, extra):
                return 0
            mapping = bm.swap_in(seq)
            out.swap_in.extend(mapping)
            self.num_blocks_swapped_in += len(mapping)
            self.swapped.remove(seq)
        else:
            free = bm.num_free_device_blocks - bm.num_taken_by(hit)
            if self.chunked_prefill:
                capacity = (len(hit) + free - self._reserve(out)) * bm.block_size - start
                n = min(n, capacity)
                if n <= 0:
                    return 0
            elif blocks_for(start + n, bm.block_size) - len(hit) > free:
                return 0
            self.waiting.remove(seq)
            bm.take_cached_prefix(seq, hit)
        bm.allocate(seq, n)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        out.add(seq, n)
        return self._chunk_cost(seq, n, budget) if self.chunked_prefill else n

    def _usable_cached_prefix(self, seq: Sequence, out: SchedulerOutput) -> list[int]:
        """The cached blocks `seq` starts on: its longest cached prefix, shortened until the pool has a
        block left for the tokens after it (a cached block nobody references is taken from the pool)."""
        bm = self.block_manager
        hit = bm.find_cached_prefix(seq)
        room = bm.num_free_device_blocks - self._reserve(out)
        while hit and bm.num_taken_by(hit) >= room:
            hit.pop()
        return hit

    def _reserve(self, out: SchedulerOutput) -> int:
        """Blocks a new prefill leaves free for growing decodes, unless this step's admissions were
        paid for by preemption or nothing else runs."""
        return self.watermark_blocks if self.running and not out.preempted else 0

    def _first_chunk(self, uncomputed: int, budget: int, first_prefill: bool) -> int:
        """Tokens to run for a sequence that starts (or resumes) this step with `uncomputed` tokens left."""
        if self.chunked_prefill:
            return min(uncomputed, budget)
        if uncomputed <= budget:
            return uncomputed
        # without chunking a prompt runs whole: one longer than what is left of the budget runs
        # as the step's first prefill (overrunning the budget, stalling decodes) so it cannot starve
        return uncomputed if first_prefill else 0

    # --- preemption -------------------------------------------------------------------------------

    def _make_room_for_urgent(self, out: SchedulerOutput) -> None:
        """Preempt running sequences strictly less urgent than one that cannot otherwise start (waiting,
        swapped) or take its next chunk (a prefill in progress when the decodes took the last blocks).

        Walks the fill's own order (decodes, then `_prefill_order`) with what each would take, so it
        preempts only for a sequence that the fill then runs in this step.
        """
        bm = self.block_manager
        decodes = [s for s in self.running if s.is_decoding]
        # blocks that running decodes will take this step stay reserved for them
        free = bm.num_free_device_blocks - sum(1 for s in decodes if bm.num_new_blocks(s, 1))
        slots = self.max_num_seqs - len(self.running)
        decode_cost = sum(self._decode_cost(s) for s in decodes)
        num_decodes, taken = len(decodes), 0  # taken: budget of the chunks counted so far
        budget = self._prefill_budget(num_decodes, decode_cost)
        first_prefill = True
        prefill_priority = None  # as in the fill: one class of prefills a step
        for cand in self._prefill_order():
            if budget <= 0:
                return
            if cand in out.preempted:
                continue
            if prefill_priority is not None and cand.priority > prefill_priority:
                return
            running = cand.status == SequenceStatus.RUNNING
            if self.chunked_prefill or running:
                n = self._chunk(cand, budget)
            else:
                n = cand.num_uncomputed_tokens
                if n > budget and not first_prefill:
                    return  # the fill will not start it this step either (see _first_chunk)
            first_prefill = first_prefill and n == 1
            reserve = 0
            if cand.status == SequenceStatus.SWAPPED:
                need = blocks_for(cand.num_computed_tokens + n, bm.block_size)
            else:
                need = bm.num_new_blocks(cand, n)
                reserve = self._reserve(out) if self.chunked_prefill and not running else 0
            while (slots < 1 and not running) or free < need + reserve:
                victim = self._least_urgent_running(exclude=out.seqs, less_urgent_than=cand)
                if victim is None:
                    break
                if victim in decodes:  # its decode's budget and its reserved block come back too
                    num_decodes, decode_cost = num_decodes - 1, decode_cost - self._decode_cost(victim)
                    budget = self._prefill_budget(num_decodes, decode_cost) - taken
                    free += 1 if bm.num_new_blocks(victim, 1) else 0
                free += len(victim.block_table)
                slots += 1
                reserve = 0  # an admission paid for by preemption keeps no reserve (see _reserve)
                self._preempt(victim, out)
            if running:  # a prefill in progress takes what it can
                capacity = (len(cand.block_table) + max(free, 0)) * bm.block_size - cand.num_computed_tokens
                n = min(n, capacity)
                free -= bm.num_new_blocks(cand, n)
                cost = self._chunk_cost(cand, n, budget)
                budget, taken = budget - cost, taken + cost
                if n > 0:
                    prefill_priority = cand.priority
                continue
            if slots < 1 or free < need + reserve:
                return  # strict priority: nobody behind `cand` may preempt for it
            free -= need
            slots -= 1
            cost = self._chunk_cost(cand, n, budget) if self.chunked_prefill else n
            budget, taken = budget - cost, taken + cost
            prefill_priority = cand.priority

    def _least_urgent_running(self, exclude: list[Sequence], less_urgent_than: Sequence | None = None):
        """The victim rule: highest priority number, latest arrival among equals."""
        victim = None
        for seq in self.running:
            if seq in exclude:
                continue
            if less_urgent_than is not None and seq.priority <= less_urgent_than.priority:
                continue
            if victim is None or _urgency(seq) > _urgency(victim):
                victim = seq
        return victim

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Checkpoint `seq`'s KV to host memory when possible, else drop it for recomputation."""
        self.running.remove(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        mapping = None
        if self.swap_enabled and seq.num_computed_tokens > 0:
            mapping = self.block_manager.swap_out(seq)
        if mapping is not None:
            out.swap_out.extend(mapping)
            self.num_blocks_swapped_out += len(mapping)
            seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, seq, key=_urgency)
        else:
            self.block_manager.free(seq)
            self.num_recomputed_tokens += seq.num_computed_tokens
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            bisect.insort(self.waiting, seq, key=_urgency)


def _urgency(seq: Sequence) -> tuple[int, float]:
    return (seq.priority, seq.arrival_time)


def _prefill_key(seq: Sequence) -> tuple[int, bool, float]:
    return (seq.priority, seq.status != SequenceStatus.RUNNING, seq.arrival_time)
