"""The order within a priority class (batching/admission_order.py), on the Scheduler with a fake runner
and a fake clock: places by predicted cost, the aging bound, deadlines at risk first, the preemption
victim, the same order whatever order the sequences are queued in (a restarted worker), step times."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from batching import EngineConfig, SamplingParams
from batching.block_manager import BlockManager
from batching.scheduler import Scheduler
from batching.sequence import Sequence, SequenceStatus
from tests.batching.test_scheduler_properties import run_fake_step

AGING = 10.0
SECONDS_PER_TOKEN = 0.1


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_scheduler(clock: Clock, policy: str = "predicted", max_num_seqs: int = 1, **config) -> Scheduler:
    """One running sequence at a time by default: admissions come one by one, in the class's order."""
    config = (
        dict(
            block_size=4,
            num_device_blocks=256,
            num_host_blocks=0,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=64,
            scheduling_policy=policy,
            aging_seconds=AGING,
            cost_seconds_per_token=SECONDS_PER_TOKEN,
        )
        | config
    )
    cfg = EngineConfig(**config)
    return Scheduler(cfg, BlockManager(cfg.num_device_blocks or 0, 0, 4), clock=clock)


def sequence(
    name: str,
    arrival: float,
    output: int,
    prompt: int = 2,
    priority: int = 5,
    predicted: int | None = None,
    deadline: float | None = None,
) -> Sequence:
    return Sequence(
        name,
        [5] * prompt,
        SamplingParams(max_tokens=output, temperature=0, ignore_eos=True),
        priority,
        sample_seed=0,
        arrival_time=arrival,
        predicted_output_tokens=predicted,
        deadline=deadline,
    )


def admission_order(sched: Scheduler, clock: Clock, arrivals: list[Sequence], seconds_per_step: float):
    """Run to the end, queueing each of `arrivals` when the clock reaches its arrival time; the order in which
    the sequences (those queued before too) start."""
    pending = sorted(arrivals, key=lambda s: s.arrival_time)
    started: list[str] = []
    while pending or sched.live_sequences():
        while pending and pending[0].arrival_time <= clock.now:
            sched.add(pending.pop(0))
        out = run_fake_step(sched)
        started += [s.req_id for s in out.seqs if s.req_id not in started]
        clock.now += seconds_per_step
    return started


def test_fcfs_places_by_arrival_and_predicted_by_cost_capped_by_aging():
    clock = Clock()
    fcfs, predicted = make_scheduler(clock, "fcfs"), make_scheduler(clock)
    short = sequence("short", 5.0, output=8, prompt=2)
    long = sequence("long", 5.0, output=2000, prompt=2)
    guessed = sequence("guessed", 5.0, output=2000, prompt=2, predicted=38)
    assert [fcfs.order.place(s) for s in (short, long, guessed)] == [5.0] * 3
    assert predicted.order.place(short) == 5.0 + 10 * SECONDS_PER_TOKEN
    assert predicted.order.place(long) == 5.0 + AGING  # 2002 tokens' 200 s capped
    assert predicted.order.place(guessed) == 5.0 + 40 * SECONDS_PER_TOKEN  # the prediction, not max_tokens


def test_short_jobs_overtake_a_long_one_that_arrived_just_before():
    clock = Clock(0.0)
    for policy, expected in (("fcfs", ["long", "a", "b"]), ("predicted", ["a", "b", "long"])):
        sched = make_scheduler(clock, policy)
        clock.now = 0.0
        jobs = [sequence("long", 0.0, 300), sequence("a", 0.5, 4), sequence("b", 0.6, 4)]
        sched.add(sequence("running", 0.0, 3))  # holds the one slot while the others arrive
        assert admission_order(sched, clock, jobs, seconds_per_step=0.2)[1:] == expected, policy


def test_aging_bounds_the_wait_of_a_long_job_under_a_stream_of_short_ones():
    """A short job arrives every step, forever: without aging the long job would never start. With it, it
    starts once the short jobs that arrived within AGING seconds after it are done, before any later one."""
    step = 0.25
    clock = Clock(0.0)
    sched = make_scheduler(clock)
    sched.add(sequence("first", -1.0, 3))  # holds the one slot as the long job arrives
    long = sequence("long", 0.0, 1000)
    shorts = [sequence(f"s{i}", 0.01 + i * step, 2) for i in range(200)]
    started = admission_order(sched, clock, [long, *shorts], seconds_per_step=step)
    overtook = started[1 : started.index("long")]
    assert overtook, "nothing overtook the long job"
    arrival = {s.req_id: s.arrival_time for s in shorts}
    assert max(arrival[name] for name in overtook) <= long.arrival_time + AGING
    assert len(overtook) >= int(AGING / step) - 2  # it did give way for about AGING seconds

    # without the cap (aging as long as the whole stream) it starts after every short job
    clock = Clock(0.0)
    sched = make_scheduler(clock, aging_seconds=10_000.0)
    sched.add(sequence("first", -1.0, 3))
    long = sequence("long", 0.0, 1000)
    shorts = [sequence(f"s{i}", 0.01 + i * step, 2) for i in range(200)]
    assert admission_order(sched, clock, [long, *shorts], seconds_per_step=step)[-1] == "long"


@settings(max_examples=60, deadline=None)
@given(
    jobs=st.lists(
        st.tuples(
            st.floats(0, 30),
            st.integers(1, 100),
            st.integers(1, 40),
            st.one_of(st.none(), st.integers(0, 500)),
        ),
        min_size=2,
        max_size=25,
    ),
    max_num_seqs=st.integers(1, 3),
    step=st.sampled_from([0.05, 0.5, 2.0]),
)
def test_no_sequence_is_overtaken_by_one_arriving_more_than_aging_seconds_after_it(jobs, max_num_seqs, step):
    """The bound, whatever the arrivals, lengths, predictions and batch width: a sequence that starts before
    another of its class, while the other waited, arrived no more than AGING seconds after it."""
    clock = Clock(0.0)
    sched = make_scheduler(clock, max_num_seqs=max_num_seqs)
    seqs = [
        sequence(f"r{i}", arrival, output, prompt=prompt, predicted=predicted)
        for i, (arrival, output, prompt, predicted) in enumerate(jobs)
    ]
    started = admission_order(sched, clock, seqs, seconds_per_step=step)
    assert sorted(started) == sorted(s.req_id for s in seqs)
    position = {name: i for i, name in enumerate(started)}
    for a in seqs:
        for b in seqs:
            if position[b.req_id] < position[a.req_id]:
                assert b.arrival_time <= a.arrival_time + AGING, f"{b.req_id} overtook {a.req_id}"


def test_a_job_near_its_deadline_overtakes_and_one_far_from_it_or_lost_keeps_its_place():
    clock = Clock(100.0)
    sched = make_scheduler(clock, deadline_margin_seconds=5.0)
    # it needs 2 + 40 tokens: a step for its prompt (and first token), 39 decode steps: 40 steps of 0.1 s
    sched.order.seconds_per_step = 0.1
    ahead = [sequence(f"a{i}", 90.0 + i, 8) for i in range(3)]
    near = sequence("near", 99.0, 40, deadline=100.0 + 4.0 + 4.0)  # 4 s of slack < 5 s margin
    far = sequence("far", 99.0, 40, deadline=100.0 + 4.0 + 60.0)
    lost = sequence("lost", 99.0, 40, deadline=100.0 + 3.0)  # too late even if it started now
    for seq in (*ahead, near, far, lost):
        sched.add(seq)
    rank = sched.order.rank
    assert sched.order.seconds_to_finish(near) == 40 * 0.1
    assert rank(near) < min(map(rank, ahead)) < rank(far)
    assert rank(lost) > max(map(rank, ahead)), "a lost deadline keeps its place"
    clock.now += 0.001  # the scheduler's step reads the clock
    sched.order.seconds_per_step = 0.1
    out = run_fake_step(sched)
    assert [s.req_id for s in out.seqs] == ["near"]
    # under fcfs deadlines change nothing
    clock = Clock(100.0)
    fcfs = make_scheduler(clock, "fcfs")
    for seq in [sequence(f"a{i}", 90.0 + i, 8) for i in range(3)] + [
        sequence("near", 99.0, 40, deadline=108)
    ]:
        fcfs.add(seq)
    assert [s.req_id for s in run_fake_step(fcfs).seqs] == ["a0"]


def test_deadlines_at_risk_go_earliest_first_and_never_across_classes():
    clock = Clock(0.0)
    sched = make_scheduler(clock, deadline_margin_seconds=100.0)
    later = sequence("later", 0.0, 4, deadline=50.0)
    sooner = sequence("sooner", 1.0, 4, deadline=20.0)
    urgent = sequence("urgent", 2.0, 400, priority=1)
    for seq in (later, sooner, urgent):
        sched.add(seq)
    assert sorted((later, sooner, urgent), key=sched.order.rank) == [urgent, sooner, later]


def test_the_victim_is_the_least_urgent_class_last_in_its_order():
    clock = Clock(0.0)
    for policy, victim in (("fcfs", "short"), ("predicted", "long")):
        # two blocks of 4 tokens each hold one sequence: an urgent arrival must preempt one
        sched = make_scheduler(clock, policy, max_num_seqs=2, num_device_blocks=4)
        long = sequence("long", 0.0, 12, prompt=2)  # predicted: its max_tokens
        short = sequence("short", 0.5, 12, prompt=2, predicted=1)
        sched.add(long)
        sched.add(short)
        run_fake_step(sched)
        run_fake_step(sched)
        sched.add(sequence("urgent", 1.0, 6, prompt=6, priority=0))
        out = run_fake_step(sched)
        assert [s.req_id for s in out.preempted] == [victim], policy


def test_the_order_is_the_same_whatever_order_the_sequences_are_queued_in():
    """A restarted worker queues its jobs again from their rows (arrival, prediction, deadline), in any
    order: they start in the same order."""
    rng = random.Random(7)
    specs = [(rng.uniform(0, 20), rng.randrange(1, 300), rng.randrange(1, 30)) for _ in range(30)]
    orders = []
    for shuffle in (False, True):
        clock = Clock(25.0)
        sched = make_scheduler(clock)
        seqs = [sequence(f"r{i}", a, out, predicted=p) for i, (a, out, p) in enumerate(specs)]
        if shuffle:
            rng.shuffle(seqs)
        for seq in seqs:
            sched.add(seq)
        orders.append(admission_order(sched, clock, [], seconds_per_step=0.1))
    assert orders[0] == orders[1]
    assert orders[0] != [f"r{i}" for i in sorted(range(30), key=lambda i: specs[i][0])], "it is not fcfs"


def test_the_step_time_estimate_follows_the_steps_that_ran_a_batch():
    clock = Clock(0.0)
    sched = make_scheduler(clock, max_num_seqs=4)
    sched.add(sequence("a", 0.0, 500))
    for _ in range(100):
        run_fake_step(sched)
        clock.now += 0.05
    assert abs(sched.order.seconds_per_step - 0.05) < 1e-3
    sched.finish(sched.running[0], SequenceStatus.FINISHED_ABORTED)
    run_fake_step(sched)  # nothing to run
    clock.now += 1000.0  # idle: no sample
    run_fake_step(sched)
    assert abs(sched.order.seconds_per_step - 0.05) < 1e-3
