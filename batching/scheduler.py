"""Decides what each engine step runs: token budget, priorities, preemption. No torch here.

A step is filled in stall-free order (Sarathi-Serve): one decode token for every running sequence,
then, priority class by priority class (0 first), the next chunks of that class's prefills in
progress, then its sequences that are not running (swapped out or waiting) in the class's order
(admission_order.py: by arrival, or by predicted cost with aging and deadlines at risk first). A step carries
the prefill chunks of one class only, the most urgent that can run: an urgent request's prefill runs
in a short step (decodes + its chunk), not one padded with less urgent prompts, so its first token
comes sooner; the budget left over waits one step. Admissions never skip ahead: none starts behind
a more urgent sequence that cannot, or behind one preempted in this step.

Preemption is decided in that one pass, where a sequence fails to get blocks or a slot (as in vLLM
and nano-vllm): a decode that finds the pool empty preempts the least urgent running sequence not
yet scheduled (maybe itself); a prefill chunk or an admission that lacks room preempts running
sequences strictly less urgent than itself, least urgent first, a decode already in this step
included (it leaves the step and gives its budget back).

Under "preemptive" a sequence also yields to its own class (least attained service, multi-level feedback as in
FastServe): one that cannot start for want of a slot or blocks preempts a running sequence of its class at a
higher *level* (levels by output tokens made: below QUANTUM_TOKENS, then one more at each doubling) that has
run its quantum since it last started (QUANTUM_TOKENS x 2^k after k preemptions: a long job yields at most
about log2(its length / QUANTUM_TOKENS) times) and whose deadline is not at risk, the highest level first. Its
KV goes to host memory (never recomputed: only a sequence that can be swapped out yields), and it resumes
where it stopped. Within a class, not-running sequences rank by level before their place; one preempted
aging_seconds ago or more is back at level 0, placed as if it arrived when it stopped (with the whole aging
shift), so a stream of new short jobs cannot hold it back for good. Between classes nothing changes.

The budget is priced, not counted (with `attention_aware_chunks`): a chunk pays for its attention and
its context, a decode for its row work and its context, at `StepCosts` prices that the engine fits on
its own step times (step_cost.py); until then a chunk pays for its attention only and a decode 1.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np

from batching.admission_order import AT_RISK, AdmissionOrder
from batching.block_manager import BlockManager, CachedPrefix, blocks_for
from batching.config import EngineConfig
from batching.sequence import Sequence, SequenceStatus
from batching.step_cost import StepCosts

# "preemptive": the first level's output tokens, and the first quantum a sequence runs (Scheduler.quantum_tokens)
QUANTUM_TOKENS = 64


@dataclass(slots=True)
class SchedulerOutput:
    """What the model runner executes this step. Plain data: sequences, token counts, block copies."""

    seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    # models with state layers: state slots copied with the blocks (state_cache.py)
    state_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (slot, host slot)
    state_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host slot, slot)
    preempted: list[Sequence] = field(default_factory=list)
    # the first num_decodes of seqs are decodes (a token each, scheduled before any chunk: _schedule_decodes)
    num_decodes: int = 0
    # the sum of those decodes' num_computed_tokens, where the scheduler knows it (step_cost.features); None: not
    decode_context: int | None = None

    def add(self, seq: Sequence, num_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_scheduled_tokens.append(num_tokens)

    def remove(self, seq: Sequence) -> None:
        i = self.seqs.index(seq)
        del self.seqs[i], self.num_scheduled_tokens[i]
        if i < self.num_decodes:
            self.num_decodes -= 1
            if self.decode_context is not None:  # (before a preemption resets its computed tokens)
                self.decode_context -= seq.num_computed_tokens

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        context_per_token: float | None = None,
        stateful: bool = False,
        clock: Callable[[], float] | None = None,
    ):
        """`context_per_token`: how many tokens of context one token's attention must span to cost as much
        as the rest of its forward pass (the model's linear layers); see `_chunk`. None: chunks cost their
        token count only. `set_costs` replaces it with prices fitted on real steps (step_cost.py).
        `stateful`: the model has state layers (state_layers.py); see `_prompt_end`. `clock`: seconds since
        the epoch, for deadlines and step times (admission_order.py); None: time.time."""
        self.stateful = stateful
        self.cost_aware = config.attention_aware_chunks
        self.costs = StepCosts(context_per_token=context_per_token if self.cost_aware else None)
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.chunked_prefill = config.enable_chunked_prefill
        self.swap_enabled = config.preemption_mode == "swap"
        self.block_manager = block_manager
        self.order = AdmissionOrder(config) if clock is None else AdmissionOrder(config, clock)
        # "preemptive": a sequence's output tokens when it last started running, and when it was last preempted
        self.preemptive = config.scheduling_policy == "preemptive"
        self._started_at: dict[Sequence, int] = {}
        self._stopped_at: dict[Sequence, float] = {}
        self._ranks: dict[Sequence, tuple[int, int, int, float, float]] = {}  # this step's, as first computed
        self.quantum_tokens = QUANTUM_TOKENS
        # a sequence's urgency, the order of every decision of a step (tests check theirs against it)
        self.rank = self._preemptive_rank if self.preemptive else self.order.rank
        self.last_budget_used = 0  # of the last schedule(): decodes' charge + chunks' costs
        # keep free a few blocks when admitting without preemption, so running decodes can grow
        self.watermark_blocks = max(1, block_manager.num_device_blocks // 100)
        self.waiting: list[Sequence] = []  # sorted by _place
        self.swapped: list[Sequence] = []  # sorted by _place
        # the waiting and swapped sequences whose rank may not follow their place (`_ranked_apart`), in the
        # order they became so (a dict: a set's order would change the order of ties from run to run)
        self._apart: dict[Sequence, None] = {}
        self.running: list[Sequence] = []  # sorted by _place (the decodes' order: no sort each step)
        # bumped by every change to the queues (add, finish, preempt, admit): a steady step checks it
        self._version = 0
        # the last schedule's decodes, when it was a steady step's (`_Steady`): the next schedules them by it
        self._steady: _Steady | None = None
        # counters
        self.num_preemptions = 0
        self.num_blocks_swapped_out = 0
        self.num_blocks_swapped_in = 0
        self.num_recomputed_tokens = 0

    # --- queue management -------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self._version += 1
        seq.status = SequenceStatus.WAITING
        seq.order_key = self.order.place(seq)  # kept through preemption: it never loses its place
        if self.preemptive and seq.num_output_tokens:
            # resumed (a worker restarted): as if preempted when queued, so aging brings it back to level 0
            self._stopped_at[seq] = self.order.clock()
        if self._ranked_apart(seq):
            self._apart[seq] = None
        bisect.insort(self.waiting, seq, key=_place)

    def live_sequences(self) -> list[Sequence]:
        return self.running + self.swapped + self.waiting

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Take `seq` out of whichever queue holds it and free its blocks."""
        self._version += 1
        queue = {
            SequenceStatus.RUNNING: self.running,
            SequenceStatus.SWAPPED: self.swapped,
            SequenceStatus.WAITING: self.waiting,
        }.get(seq.status)
        if queue is not None:
            queue.remove(seq)
        self._apart.pop(seq, None)
        if self.preemptive:
            self._started_at.pop(seq, None)
            self._stopped_at.pop(seq, None)
            self._ranks.pop(seq, None)
        self.block_manager.free(seq)
        seq.status = status

    # --- one step ---------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        fill = _Fill(SchedulerOutput())
        self.order.start_step()
        self._ranks.clear()
        self.block_manager.start_step()
        steady, self._steady = self._steady, None
        if steady is None or not self._schedule_steady(steady, fill):
            bm, bs = self.block_manager, self.block_manager.block_size
            if bm.enable_prefix_caching:  # the last step computed their KV: full blocks join the prefix cache
                for seq in self.running:  # (a block filled: 1 in bs)
                    if seq.num_computed_tokens // bs > seq.num_cache_offered_blocks:
                        bm.cache_computed_blocks(seq)
            self._schedule_decodes(fill)
            self._schedule_prefills(fill)
        self.last_budget_used = self.max_num_batched_tokens - self._budget(fill)
        bm = self.block_manager
        if bm.offloads or bm.loads:
            offloads, loads = bm.take_copies()  # the prefix cache's host tier
            fill.out.swap_out.extend(offloads)
            fill.out.swap_in.extend(loads)
        if bm.state_swap_out or bm.state_swap_in:
            fill.out.state_swap_out, fill.out.state_swap_in = bm.take_state_copies()
        self.order.end_step(busy=bool(fill.out.seqs))
        return fill.out

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

    def _budget(self, fill: _Fill) -> int:
        """What is left of the step's budget for prefill chunks: what the decodes leave, less the chunks
        taken. Priced decodes take at most half the budget (beyond that, many long contexts): prefills
        keep the other half, so admissions, urgent ones first, never wait for decodes to finish."""
        charge = max(fill.out.num_decodes, min(round(fill.decode_cost), self.max_num_batched_tokens // 2))
        return self.max_num_batched_tokens - charge - fill.taken

    def _schedule_decodes(self, fill: _Fill) -> None:
        """A token for every running decode (up to the budget in tokens), most urgent first; a decode
        that finds the pool empty preempts the least urgent running sequence not yet scheduled (itself,
        if that is it). A decode whose last token (still on the device, engine.py) is its last is not
        scheduled: it ends when that token reaches the host."""
        bm = self.block_manager
        decoding = [  # most urgent first: running is in that order
            s
            for s in self.running
            if s.num_computed_tokens == len(s.token_ids) - 1 > s.num_prompt_tokens - 1
            and len(s.token_ids) < s.max_num_tokens
        ]
        if len(decoding) <= self.max_num_batched_tokens and self._schedule_decodes_at_once(decoding, fill):
            return
        for seq in decoding:
            if len(fill.decodes) == self.max_num_batched_tokens:
                break
            if seq.status != SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            while not bm.can_allocate(seq, 1):
                victim = self._least_urgent_running(exclude=fill.out.seqs)
                self._preempt(victim, fill)
                if victim is seq:
                    break
            if seq.status == SequenceStatus.RUNNING:
                bm.allocate(seq, 1)
                fill.out.add(seq, 1)
                fill.out.num_decodes += 1
                fill.decodes.add(seq)
                fill.decode_cost += self._decode_cost(seq)

    def _schedule_decodes_at_once(self, decoding: list[Sequence], fill: _Fill) -> bool:
        """The common step: the pool has a block for every decode that needs one, so none preempts and
        all are scheduled in one pass (what the loop above would do, without its per-sequence checks).
        False, and nothing done, when it does not."""
        bm, bs = self.block_manager, self.block_manager.block_size
        growing = [s for s in decoding if len(s.block_table) * bs <= s.num_computed_tokens]
        if sum(bm.num_new_blocks(s, 1) for s in growing) > bm.num_free_device_blocks:
            return False
        bm.append_blocks(growing)
        self._take_decodes(decoding, sum(map(_computed, decoding)), fill)
        fill.decodes.update(decoding)
        fill.all_decoding = len(decoding) == len(self.running)
        if fill.all_decoding and not self.swapped and not self.waiting and decoding:
            self._steady = _Steady.of(decoding, self._version)
        return True

    def _take_decodes(self, decoding: list[Sequence], context: int, fill: _Fill) -> None:
        """`decoding` (every one with its block) as the step's decodes, a token each, in one pass; `context`: the
        sum of their num_computed_tokens, priced as the sum of their `_decode_cost`."""
        out = fill.out
        out.seqs.extend(decoding)
        out.num_scheduled_tokens.extend([1] * len(decoding))
        out.num_decodes = len(decoding)
        out.decode_context = context
        c = self.costs.decode_context_per_token
        fill.decode_cost += self.costs.decode_tokens * len(decoding) + (context / c if c else 0.0)

    @property
    def version(self) -> int:
        """Changes whenever the queues change (a sequence added, started, preempted or finished; its status or
        num_preemptions with it); otherwise the same from step to step."""
        return self._version

    def forget_steady(self) -> None:
        """The last schedule's step did not run (its forward failed): the next schedules from scratch."""
        self._steady = None

    def _schedule_steady(self, steady: _Steady, fill: _Fill) -> bool:
        """The steady step: the last step decoded every running sequence, nothing waits or is swapped out, and
        the queues have not changed since (`_version`), so each of those sequences computed exactly the one
        token the last step gave it and is decoding again: the same decodes in the same order, their positions
        one further (numpy), and only the sequences that crossed into a new block (one in block_size) are looked
        at one by one: their full block offered to the prefix cache, a new block allocated. What the first step
        of this kind decided (`_schedule_decodes_at_once`, and nothing for prefills) is decided again, without a
        pass over the running sequences. False, and nothing scheduled, where it does not apply (one reaches its
        last token; the pool lacks blocks for those that grow): the step is scheduled from scratch."""
        decoding = steady.seqs
        if (
            steady.version != self._version
            or steady.margin <= 1  # one's next token would be its last (async scheduling: not scheduled)
            or len(decoding) > self.max_num_batched_tokens
        ):
            return False
        bm, bs = self.block_manager, self.block_manager.block_size
        computed: np.ndarray | list[int]  # [n]: each sequence's num_computed_tokens now
        if isinstance(steady.computed, np.ndarray):
            computed = steady.computed + 1
            crossed = np.flatnonzero(computed % bs == 0).tolist()  # (a block filled: its KV is computed)
        else:  # a few: numpy's calls cost more than they save
            computed = [c + 1 for c in steady.computed]
            crossed = [i for i, c in enumerate(computed) if c % bs == 0]
        filled = [decoding[i] for i in crossed]
        bm.cache_filled_blocks(filled)
        growing = [seq for seq in filled if len(seq.block_table) * bs <= seq.num_computed_tokens]
        if len(growing) > bm.num_free_device_blocks:
            return False  # some would preempt: from scratch (the offers above are the same there)
        bm.append_blocks(growing)
        sum_computed = steady.sum_computed + len(decoding)
        self._take_decodes(decoding, sum_computed, fill)
        fill.all_decoding = True
        # (no prefill order: every running sequence decodes, none waits, none is swapped out)
        steady.computed, steady.margin, steady.sum_computed = computed, steady.margin - 1, sum_computed
        self._steady = steady
        return True

    def _prefill_order(self, fill: _Fill) -> tuple[Iterable[Sequence], list[Sequence]]:
        """Who gets the budget left after decodes: by priority; within a priority, prefills in progress
        first (stall-free), then swapped and waiting sequences in the class's order (`AdmissionOrder.rank`).
        A less urgent prefill in progress therefore never holds back a more urgent request (its blocks
        stay; it only waits). Returns that order, made as it is read, and the prefills in progress in it.

        Only the prefills in progress and the sequences ranked apart from their place (`_ranked_apart`: a few)
        are sorted; the rest of the waiting and swapped queues are in rank order already (sorted by place), and
        are merged in as far as the step reads: a backlog of hundreds costs a step what it reads of it, not a
        sort (512 waiting: ~0.7 ms a step before)."""
        if fill.all_decoding and not self.swapped and not self.waiting:
            return (), []  # the common step: nothing to order
        prefilling = [
            s
            for s in self.running
            if not s.num_computed_tokens == len(s.token_ids) - 1 > s.num_prompt_tokens - 1
        ]  # not is_decoding
        rank, apart = self.rank, self._apart

        def key(s: Sequence):
            return (s.priority, s.status != SequenceStatus.RUNNING, rank(s))

        ranked = sorted(prefilling + list(apart), key=key)
        if not apart:  # (copies: the step's preemptions and admissions change the queues as it reads)
            in_place = [list(self.swapped), list(self.waiting)]
        else:
            in_place = [[s for s in queue if s not in apart] for queue in (self.swapped, self.waiting)]
        return heapq.merge(ranked, *in_place, key=key), prefilling

    def _ranked_apart(self, seq: Sequence) -> bool:
        """Whether a waiting or swapped sequence's rank may not follow its place (`_place`): a deadline, which
        can put it first in its class ("predicted" and "preemptive"), or, under "preemptive", a preemption (its
        level and aging). Every other such sequence's rank orders as its place does."""
        return (self.order.predicted and seq.deadline is not None) or (
            self.preemptive and seq in self._stopped_at
        )

    def _schedule_prefills(self, fill: _Fill) -> None:
        """Chunks of one priority class within the budget, in `_prefill_order`. Each sequence that
        cannot take its chunk or start for want of blocks or a slot preempts, there and then, running
        sequences strictly less urgent than itself (see `_make_room`)."""
        admitting = True
        prefill_priority = None  # the class whose chunks this step carries: one class a step
        order, prefilling = self._prefill_order(fill)
        prefills_left = len(prefilling)
        for seq in order:
            if prefills_left and seq in prefilling:
                prefills_left -= 1
            elif not admitting and not prefills_left:
                return  # nobody left to read: no prefill in progress, and nobody may start
            if self._budget(fill) <= 0:
                return
            if seq in fill.out.preempted:  # no ping-pong within one step
                continue
            if prefill_priority is not None and seq.priority > prefill_priority:
                return  # an urgent prefill runs in a short step: no less urgent chunk rides along
            if seq.status == SequenceStatus.RUNNING:
                taken = self._schedule_chunk(seq, fill)
            elif not admitting:
                continue
            elif self._waits_for_shared_prefill(seq):
                # it starts on the blocks that prefill computes, when they are cached; strict order
                # still: nobody behind it starts meanwhile (a step or so: the prefill computes them now)
                admitting = False
                continue
            elif any(self.rank(v) < self.rank(seq) for v in fill.out.preempted):
                # a sequence preempted in this step keeps its place: nobody behind it starts in the
                # room it left
                admitting = False
                continue
            else:
                taken = self._admit(seq, fill)
                # strict order: nobody starts ahead of the most urgent sequence that cannot start
                admitting = taken > 0
            if taken:
                fill.taken += taken
                prefill_priority = seq.priority

    def _schedule_chunk(self, seq: Sequence, fill: _Fill) -> int:
        """The next chunk of a prefill in progress; returns the budget it took."""
        bm = self.block_manager
        self._make_room(
            seq, fill, lambda: bm.max_tokens_allocatable(seq) < self._room_needed(seq, self._budget(fill))
        )
        n = self._next_chunk(seq, fill)
        if n == 0:
            # pool exhausted, and nothing less urgent to preempt: a prefill that cannot move while
            # others hold all blocks would deadlock, so the least urgent running sequence not yet
            # scheduled (maybe this one) yields
            victim = self._least_urgent_running(exclude=fill.out.seqs)
            self._preempt(victim, fill)
            if victim is seq:
                return 0
            n = self._next_chunk(seq, fill)
            if n == 0:
                return 0
        budget = self._budget(fill)
        bm.allocate(seq, n)
        fill.out.add(seq, n)
        return self._chunk_cost(seq, n, budget)

    def _room_needed(self, seq: Sequence, budget: int) -> int:
        """The slots a running prefill's next chunk takes: its tokens within `budget`, or two where a single token
        would leave a state model's last prompt token alone (`_prompt_end` takes both). Less room makes the chunk
        none, and the prefill would yield its own place though a less urgent sequence held the slot it lacked."""
        n = self._chunk(seq, budget)
        # _prompt_end's own rule, given room for it: one token more where it would take two
        return max(n, self._prompt_end(seq, seq.num_computed_tokens, n, room=n + 1))

    def _next_chunk(self, seq: Sequence, fill: _Fill) -> int:
        """The tokens of a running prefill's next chunk, within the budget and the blocks free now."""
        room = self.block_manager.max_tokens_allocatable(seq)
        n = min(self._chunk(seq, self._budget(fill)), room)
        return self._prompt_end(seq, seq.num_computed_tokens, n, room)

    def _prompt_end(self, seq: Sequence, start: int, n: int, room: int) -> int:
        """A model with state layers: a chunk never ends one token short of its prompt's end. That
        token, run alone from the state, would take its layers' single-token path, which `generate()`
        takes for generated tokens only, and which rounds differently from the whole-sequence path the
        prompt takes (state_layers.py). Such a chunk takes a token less, or, being a single token, one
        more (past the budget by that token) if `room` (slots) allows, else none."""
        if not self.stateful or n == 0 or start + n != seq.num_prompt_tokens - 1:
            return n
        if n > 1:
            return n - 1
        return 2 if room >= 2 else 0

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

    # --- admission --------------------------------------------------------------------------------

    def _admit(self, seq: Sequence, fill: _Fill) -> int:
        """Swap in or start a not-running sequence with its first chunk, preempting for it if it lacks
        blocks or a slot; returns the budget it took (0: it cannot start)."""
        bm = self.block_manager
        plan = self._plan_admission(seq, fill)  # planned again only after a preemption
        while plan[2] < plan[1] and self._preempt_less_urgent(seq, fill):  # it lacks room
            plan = self._plan_admission(seq, fill)
        if self.preemptive:
            plan = self._yield_in_class(seq, fill, plan)
        hit, _, n = plan
        if n == 0:
            return 0  # nothing changed: a backlog that cannot start leaves the version (step_deltas' epoch) as is
        self._version += 1
        budget, out = self._budget(fill), fill.out
        if seq.status == SequenceStatus.SWAPPED:
            mapping = bm.swap_in(seq)
            assert mapping is not None  # can_swap_in said it fits
            out.swap_in.extend(mapping)
            self.num_blocks_swapped_in += len(mapping)
            self.swapped.remove(seq)
        else:
            self.waiting.remove(seq)
            bm.take_cached_prefix(seq, hit)
        self._apart.pop(seq, None)
        bm.allocate(seq, n)
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=_place)
        if self.preemptive:
            self._started_at[seq] = seq.num_output_tokens
            self._stopped_at.pop(seq, None)
        out.add(seq, n)
        return self._chunk_cost(seq, n, budget) if self.chunked_prefill else n

    def _plan_admission(self, seq: Sequence, fill: _Fill) -> tuple[CachedPrefix, int, int]:
        """What `seq` would start with now: (the cached blocks it starts on, the tokens of the first
        chunk it wants, the tokens it can have with the slots and blocks free now). A sequence that
        starts from scratch begins after the longest prefix of its tokens whose KV is cached
        (block_manager.py) and computes only the rest. Chunked, a new prefill takes what fits, leaving
        the reserve free; whole prompts and swapped-in sequences have all they want or nothing."""
        bm = self.block_manager
        waiting = seq.status == SequenceStatus.WAITING
        # a sequence lacking log probabilities computes their positions: it starts on no cached prefix
        hit = (
            self._usable_cached_prefix(seq, fill.out)
            if waiting and not seq.lacks_logprobs
            else CachedPrefix()
        )
        start = seq.num_computed_tokens + len(hit) * bm.block_size
        budget = self._budget(fill)
        want = self._first_chunk(seq.num_tokens - start, budget, fill.out)
        if want and self.chunked_prefill:
            want = self._prompt_end(
                seq, start, min(want, self._chunk(seq, budget, start)), seq.num_tokens - start
            )
        if want == 0 or len(self.running) >= self.max_num_seqs:
            return hit, want, 0
        if seq.status == SequenceStatus.SWAPPED:
            extra = blocks_for(seq.num_computed_tokens + want, bm.block_size) - len(seq.host_block_table)
            return hit, want, want if bm.can_swap_in(seq, extra) else 0
        free = bm.num_free_device_blocks - bm.num_taken_by(hit)
        if self.chunked_prefill:
            capacity = (len(hit) + free - self._reserve(fill.out)) * bm.block_size - start
            return hit, want, self._prompt_end(seq, start, max(0, min(want, capacity)), capacity)
        fits = blocks_for(start + want, bm.block_size) - len(hit) <= free
        return hit, want, want if fits else 0

    def _waits_for_shared_prefill(self, seq: Sequence) -> bool:
        """Whether `seq`, waiting to start, would compute blocks of its prompt that a running prefill as
        urgent as it computes now (a prompt's n choices, the same system prompt): then it waits, and starts
        on them from the prefix cache once computed, so a shared prompt is computed once, not once per
        sequence. Never for a sequence that computes every position anyway (prompt log probabilities)."""
        bm = self.block_manager
        if not bm.enable_prefix_caching or seq.status != SequenceStatus.WAITING or seq.lacks_logprobs:
            return False
        full = (seq.num_tokens - 1) // bm.block_size  # the blocks it could start on
        if full == 0 or not self.running:
            return False
        cached = len(bm.find_cached_prefix(seq))
        if cached == full:
            return False
        lacking = bm.block_hashes(seq, cached + 1)[cached]  # the first block it would compute
        return any(
            not other.is_decoding
            and other.priority <= seq.priority
            and other.num_computed_tokens < (cached + 1) * bm.block_size <= other.num_tokens
            and bm.block_hashes(other, cached + 1)[cached] == lacking
            for other in self.running
        )

    def _usable_cached_prefix(self, seq: Sequence, out: SchedulerOutput) -> CachedPrefix:
        """The cached blocks `seq` starts on: its longest cached prefix, shortened until the pool has a
        block left for the tokens after it (a cached block nobody references, or one copied back from
        the host, is taken from the pool)."""
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

    def _first_chunk(self, uncomputed: int, budget: int, out: SchedulerOutput) -> int:
        """Tokens to run for a sequence that starts (or resumes) this step with `uncomputed` tokens left."""
        if self.chunked_prefill:
            return min(uncomputed, budget)
        if uncomputed <= budget:
            return uncomputed
        # without chunking a prompt runs whole: one longer than what is left of the budget runs
        # as the step's first prefill (overrunning the budget, stalling decodes) so it cannot starve
        first_prefill = all(k == 1 for k in out.num_scheduled_tokens)
        return uncomputed if first_prefill else 0

    # --- preemption -------------------------------------------------------------------------------

    def _make_room(self, seq: Sequence, fill: _Fill, lacks_room) -> None:
        """While `lacks_room()`, preempt the least urgent running sequence strictly less urgent than
        `seq`. The fill's order (by priority) makes every prefill chunk already in this step at least as
        urgent as `seq`, so victims are decodes of this step (which give back their token and budget)
        and sequences not reached yet."""
        while lacks_room() and self._preempt_less_urgent(seq, fill):
            pass

    def _preempt_less_urgent(self, seq: Sequence, fill: _Fill) -> bool:
        """Preempt the least urgent running sequence strictly less urgent than `seq`; False if there is none."""
        victim = self._least_urgent_running(exclude=[], less_urgent_than=seq)
        if victim is None:
            return False
        self._preempt(victim, fill)
        return True

    def _least_urgent_running(self, exclude: list[Sequence], less_urgent_than: Sequence | None = None):
        """The victim rule: highest priority number, then the last in the class's order (the latest arrival
        under "fcfs"; under "predicted" the latest place, one whose deadline is at risk only when no other is left)."""
        victim, victim_rank = None, None
        for seq in self.running:
            if seq in exclude:
                continue
            if less_urgent_than is not None and seq.priority <= less_urgent_than.priority:
                continue
            rank = self.rank(seq)
            if victim_rank is None or rank > victim_rank:
                victim, victim_rank = seq, rank
        return victim

    def _yield_in_class(
        self, seq: Sequence, fill: _Fill, plan: tuple[CachedPrefix, int, int]
    ) -> tuple[CachedPrefix, int, int]:
        """Under "preemptive": while `seq` cannot start at all (no slot, or no blocks), preempt the running
        sequence of its class that yields to it (`_yields_to`) at the highest level, the last in the class's
        order among equals. `plan`: `_plan_admission`'s now; returns it as it stands after the yields."""
        level = self._preemptive_rank(seq)[2]
        while plan[1] > 0 and plan[2] == 0:
            victims = [r for r in self.running if self._yields_to(r, seq, level, fill)]
            if not victims:
                break
            self._preempt(max(victims, key=self._preemptive_rank), fill)
            plan = self._plan_admission(seq, fill)
        return plan

    def _yields_to(self, running: Sequence, seq: Sequence, level: int, fill: _Fill) -> bool:
        """Whether `running` gives its slot to `seq` (of level `level`): the same class, a higher level, its
        quantum run since it started, no deadline at risk, no chunk in this step, and room on the host for its
        KV (a yield never costs a recomputation)."""
        if running.priority != seq.priority:
            return False
        rank = self._preemptive_rank(running)
        ran = running.num_output_tokens - self._started_at.get(running, 0)
        return (
            rank[2] > level  # a deadline at risk is at level 0
            and ran >= self.quantum_tokens << min(running.num_preemptions, 32)
            and self.swap_enabled
            and (running in fill.decodes or running not in fill.out.seqs)
            and self.block_manager.can_swap_out(running)
        )

    def _preemptive_rank(self, seq: Sequence) -> tuple[int, int, int, float, float]:
        """Under "preemptive", its urgency: (priority, deadline at risk or not, level, place or deadline, arrival),
        the class's order (admission_order.py) with the level before the place. A deadline at risk is at level 0;
        so is a sequence preempted aging_seconds ago or more, placed at its stop + aging_seconds. As first
        computed in the step, whatever the step does to it (one order for all its decisions)."""
        rank = self._ranks.get(seq)
        if rank is not None:
            return rank
        priority, risk, key, arrival = self.order.rank(seq)
        stopped = self._stopped_at.get(seq)
        if risk == AT_RISK:
            rank = (priority, risk, 0, key, arrival)
        elif stopped is not None and self.order.now - stopped >= self.order.aging_seconds:
            rank = (priority, risk, 0, stopped + self.order.aging_seconds, arrival)
        else:
            rank = (priority, risk, level(seq.num_output_tokens, self.quantum_tokens), key, arrival)
        self._ranks[seq] = rank
        return rank

    def _preempt(self, seq: Sequence, fill: _Fill) -> None:
        """Checkpoint `seq`'s KV to host memory when possible, else drop it for recomputation. A decode
        already scheduled in this step leaves the step."""
        out = fill.out
        self._version += 1
        if seq in fill.decodes:
            fill.decodes.remove(seq)
            fill.decode_cost -= self._decode_cost(seq)
            out.remove(seq)
        self.running.remove(seq)
        if self.preemptive:
            self._started_at.pop(seq, None)
            self._stopped_at[seq] = self.order.now
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        mapping = None
        if self.swap_enabled and seq.num_computed_tokens > 0:
            mapping = self.block_manager.swap_out(seq)
        if self._ranked_apart(seq):
            self._apart[seq] = None
        if mapping is not None:
            out.swap_out.extend(mapping)
            self.num_blocks_swapped_out += len(mapping)
            seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, seq, key=_place)
        else:
            self.block_manager.free(seq)
            self.num_recomputed_tokens += seq.num_computed_tokens
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            bisect.insort(self.waiting, seq, key=_place)


@dataclass(slots=True)
class _Fill:
    """One step's fill in progress: the output so far, its decodes with their budget charge, and the
    budget its prefill chunks took."""

    out: SchedulerOutput
    decodes: set[Sequence] = field(default_factory=set)
    decode_cost: float = 0.0  # their charge: the sum of their _decode_cost
    taken: int = 0
    # every running sequence is one of its decodes (none prefilling; set where that is known at no cost)
    all_decoding: bool = False


@dataclass(slots=True)
class _Steady:
    """A steady step's decodes (every running sequence, in order), as that step scheduled them: the queues'
    `_version` then, their num_computed_tokens [n], the fewest tokens any has left before its max_num_tokens
    (its last token is never scheduled), and the sum of their num_computed_tokens (the decodes' budget)."""

    seqs: list[Sequence]
    version: int
    computed: np.ndarray | list[int]  # (a list for a few)
    margin: int
    sum_computed: int

    @staticmethod
    def of(decoding: list[Sequence], version: int) -> _Steady:
        computed: np.ndarray | list[int] = list(map(_computed, decoding))
        total = sum(computed)
        if len(decoding) >= FEW_DECODES:
            computed = np.array(computed, np.int64)
        margin = min(s.max_num_tokens - len(s.token_ids) for s in decoding)
        return _Steady(list(decoding), version, computed, margin, total)


# below this many decodes, numpy's calls cost more than they save: a steady step's positions are a list, not an
# array, and the runner packs the step in plain Python (ModelRunner._few_decodes)
FEW_DECODES = 16


_computed = attrgetter("num_computed_tokens")


def level(num_output_tokens: int, quantum: int) -> int:
    """A sequence's level under "preemptive", by its output tokens: 0 below `quantum`, then one more at each
    doubling (bench/within_class_model.py's `level`)."""
    return 0 if num_output_tokens < quantum else (num_output_tokens // quantum).bit_length()


def _place(seq: Sequence) -> tuple[int, float, float]:
    """A sequence's standing apart from deadlines: its class, then its place in it (admission_order.py), the
    first come first among equal places."""
    return (seq.priority, seq.order_key, seq.arrival_time)
