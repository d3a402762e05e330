"""The order of sequences within a priority class: who starts first among equals. No torch here.

Between classes the scheduler is strict (0 first). Within a class, `EngineConfig.scheduling_policy`:

- "fcfs": by arrival.
- "predicted": by a *place* fixed when the sequence is queued,

      place = arrival_time + min(predicted cost x cost_seconds_per_token, aging_seconds)

  where the predicted cost is the tokens it is expected still to compute (uncomputed prompt tokens plus
  predicted output tokens, `Sequence.num_predicted_tokens_left`). Short work goes ahead of long work
  that arrived a little earlier (shortest first, as "Efficient LLM Scheduling by Learning to Rank" and
  SGLang's policies do), and **aging bounds the wait**: a place is never later than arrival + aging_seconds,
  and never earlier than the arrival, so a sequence arriving at t is overtaken only by sequences of its
  class arriving before t + aging_seconds. It waits at most what it would wait under first come, first
  served had it arrived aging_seconds later (tests/batching/test_admission_order.py checks the bound).
  The place is derived from values a job's row holds (its arrival, prompt, prediction), so a worker that
  restarts and queues the same jobs again puts them in the same order.

  **Deadlines**: a sequence whose deadline is *at risk* goes first in its class, earliest deadline first.
  At risk: the time it is predicted to need, from now, leaves less than `deadline_margin_seconds` of
  slack. The time it needs is its steps (a prefill chunk of up to the step budget, then one token a step)
  times the seconds a step takes, measured on the engine's own steps. A sequence predicted to miss its
  deadline even if it started now is not at risk but lost: it keeps its place (EDF's domino effect,
  where hopeless work pushes feasible work past its deadlines too, is avoided).

Preemption uses the same order backwards: the victim is the least urgent class's last (scheduler.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from batching.config import EngineConfig
from batching.sequence import Sequence

# (priority, 0 at risk / 1 otherwise, deadline / place, arrival: first come among equals): smaller goes first
Rank = tuple[int, int, float, float]
AT_RISK, IN_PLACE = 0, 1
# a step's measured time moves the estimate by this share (about the last 10 steps count)
STEP_TIME_SMOOTHING = 0.1
MAX_STEP_SECONDS = 10.0  # longer gaps between steps are an idle engine, not a step


def place(
    arrival_time: float, predicted_tokens_left: int, seconds_per_token: float, aging_seconds: float
) -> float:
    """A place within a class under "predicted": the arrival, moved back by the predicted cost, at most by the
    aging bound. The one formula for the engine's waiting sequences and a worker's waiting messages
    (workers/queue_order.py)."""
    return arrival_time + min(predicted_tokens_left * seconds_per_token, aging_seconds)


def at_risk(deadline: float, now: float, seconds_to_finish: float, margin: float) -> bool:
    """Whether a deadline is at risk: predicted to be met, with less than `margin` seconds of slack."""
    return 0.0 <= deadline - now - seconds_to_finish < margin


class AdmissionOrder:
    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.time):
        """`clock`: seconds since the epoch (deadlines and arrival times are in these); tests pass their own."""
        self.predicted = config.scheduling_policy in ("predicted", "preemptive")  # preemptive: scheduler.py
        self.aging_seconds = config.aging_seconds
        self.seconds_per_token = config.cost_seconds_per_token
        self.margin = config.deadline_margin_seconds
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.clock = clock
        # throughput estimate: seconds one engine step takes (one output token of each running sequence)
        self.seconds_per_step = config.cost_seconds_per_token
        self.now = clock()  # of the step being scheduled: one value for all its decisions
        self._last_busy_step: float | None = None
        self._ranks: dict[Sequence, Rank] = {}  # this step's, as first computed: one rank per step

    def place(self, seq: Sequence) -> float:
        """Where `seq` stands in its class, fixed once it is queued (`Sequence.order_key`)."""
        if not self.predicted:
            return seq.arrival_time
        return place(
            seq.arrival_time, seq.num_predicted_tokens_left, self.seconds_per_token, self.aging_seconds
        )

    def rank(self, seq: Sequence) -> Rank:
        """Its urgency in this step: priority, then a deadline at risk (earliest first), then its place. A
        sequence with a deadline keeps the rank first computed in the step, whatever the step does to it (a
        cached prefix, a preemption), so every decision of a step follows one order."""
        deadline = seq.deadline
        if deadline is None or not self.predicted:
            return (seq.priority, IN_PLACE, seq.order_key, seq.arrival_time)
        rank = self._ranks.get(seq)
        if rank is None:
            risky = at_risk(deadline, self.now, self.seconds_to_finish(seq), self.margin)
            key = deadline if risky else seq.order_key
            rank = self._ranks[seq] = (seq.priority, AT_RISK if risky else IN_PLACE, key, seq.arrival_time)
        return rank

    def seconds_to_finish(self, seq: Sequence) -> float:
        """Predicted time from now to its last token if it ran from now: its uncomputed tokens in chunks of a
        step's budget (the last one samples its next token), then a step per further predicted token."""
        uncomputed = seq.num_uncomputed_tokens
        more = seq.num_predicted_tokens_left - uncomputed  # output tokens after the next one
        steps = math.ceil(uncomputed / self.max_num_batched_tokens) + max(0, more - 1)
        return steps * self.seconds_per_step

    def start_step(self) -> None:
        """A step is being scheduled: read the clock; the time since the last step that ran a batch is a
        sample of the step time."""
        if not self.predicted:
            return
        self._ranks.clear()
        self.now = now = self.clock()
        if (
            self._last_busy_step is not None
            and 0.0 <= (elapsed := now - self._last_busy_step) < MAX_STEP_SECONDS
        ):
            self.seconds_per_step += STEP_TIME_SMOOTHING * (elapsed - self.seconds_per_step)

    def end_step(self, busy: bool) -> None:
        """The step scheduled a batch (`busy`) or nothing: only a busy step's end starts a step-time sample."""
        self._last_busy_step = self.now if busy and self.predicted else None
