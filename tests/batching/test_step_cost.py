"""Step prices fitted on the engine's own steps (batching/step_cost.py), and the scheduler charging them."""

from __future__ import annotations

import random

import pytest

from batching import EngineConfig, SamplingParams, step_cost
from batching.block_manager import BlockManager
from batching.scheduler import Scheduler
from batching.sequence import Sequence
from batching.step_cost import StepCostModel, StepCosts
from tests.batching.test_scheduler_properties import run_fake_step


def synthetic_steps(n: int, seed: int = 0, noise: float = 0.0):
    """Step make-ups and durations from known prices: 1 ms a step, 0.1 ms a prefill token, C = 1000,
    a chunk's context at 20 tokens a prefill token, a decode 3 tokens plus its context at 100."""
    rng = random.Random(seed)
    for _ in range(n):
        chunks = [(rng.randrange(0, 1500), rng.randrange(1, 200)) for _ in range(rng.randrange(0, 3))]
        decodes = [rng.randrange(1, 2000) for _ in range(rng.randrange(0, 12))]
        tokens = sum(k for _, k in chunks)
        attention = sum(k * (s + k / 2) for s, k in chunks)
        chunk_context = sum(s for s, _ in chunks)
        make_up = (tokens, attention, chunk_context, len(decodes), sum(decodes))
        price = tokens + attention / 1000 + chunk_context / 20 + 3 * len(decodes) + sum(decodes) / 100
        yield make_up, 1e-3 + 1e-4 * price * (1 + rng.uniform(-noise, noise))


def test_the_fit_recovers_known_prices():
    model = StepCostModel()
    fits = [
        c
        for make_up, seconds in synthetic_steps(2000, noise=0.02)
        if (c := model.record(make_up, seconds)) is not None
    ]
    assert fits, "no fit after 2000 steps"
    costs = fits[-1]
    assert costs.context_per_token == pytest.approx(1000, rel=0.1)
    assert costs.chunk_context_per_token == pytest.approx(20, rel=0.1)
    assert costs.decode_tokens == pytest.approx(3, rel=0.1)
    assert costs.decode_context_per_token == pytest.approx(100, rel=0.1)


def test_no_fit_before_enough_steps_and_none_from_useless_data():
    model = StepCostModel()
    assert all(model.record(m, s) is None for m, s in synthetic_steps(step_cost.MIN_STEPS - 1))
    flat = StepCostModel()
    for _ in range(step_cost.MIN_STEPS + step_cost.REFIT_EVERY):
        assert flat.record((0.0, 0.0, 0.0, 2.0, 100.0), 0.01) is None  # no prefill token ever: no unit


def test_a_term_fitted_below_zero_is_dropped():
    model = StepCostModel()
    fit = None
    # durations fall with decodes: a negative price, which the budget must not use
    for make_up, seconds in synthetic_steps(1500):
        fit = model.record(make_up, max(1e-4, seconds - 5e-4 * make_up[3])) or fit
    assert fit is not None and fit.decode_tokens == 1.0 and fit.context_per_token is not None


def decode_and_prefill(costs: StepCosts | None, aware: bool = True):
    """One step: 4 sequences decoding at context 300 and a waiting prompt of 200 tokens; budget 64.
    Prompts of their own: nothing comes from the prefix cache."""
    config = EngineConfig(
        block_size=4,
        num_device_blocks=400,
        num_host_blocks=0,
        max_num_batched_tokens=64,
        attention_aware_chunks=aware,
    )
    sched = Scheduler(config, BlockManager(400, 0, 4), 1e9)
    for i in range(4):
        sched.add(
            Sequence(
                f"d{i}", [10 + i] * 300, SamplingParams(max_tokens=50, temperature=0), 5, 0, arrival_time=i
            )
        )
    while any(s.num_computed_tokens < 300 for s in sched.running + sched.waiting):
        run_fake_step(sched)
    sched.add(Sequence("p", [9] * 200, SamplingParams(max_tokens=1, temperature=0), 5, 0, arrival_time=9.0))
    if costs is not None:
        sched.set_costs(costs)
    out = run_fake_step(sched)
    return dict(zip((s.req_id for s in out.seqs), out.num_scheduled_tokens)), sched.last_budget_used


def test_decodes_pay_their_price_and_prefills_get_the_rest():
    plain, used = decode_and_prefill(None)
    assert plain["p"] == 60 and used == 64  # 4 decodes at 1 token each
    # each decode: 2 tokens + 300/100 of context = 5; 4 of them: 20, prefill gets 44
    priced, used = decode_and_prefill(
        StepCosts(context_per_token=None, decode_tokens=2.0, decode_context_per_token=100.0)
    )
    assert all(priced[f"d{i}"] == 1 for i in range(4)) and priced["p"] == 44 and used == 64


def test_decodes_take_at_most_half_the_budget():
    priced, used = decode_and_prefill(StepCosts(decode_tokens=50.0))
    assert priced["p"] == 32 and used == 64  # 4 x 50 would leave nothing: capped at 32


def test_prices_are_ignored_with_cost_aware_budgets_off():
    plain, _ = decode_and_prefill(StepCosts(decode_tokens=5.0), aware=False)
    assert plain["p"] == 60


def test_a_chunk_with_context_pays_for_it():
    config = EngineConfig(block_size=4, num_device_blocks=200, num_host_blocks=0, max_num_batched_tokens=64)
    sched = Scheduler(config, BlockManager(200, 0, 4), None)
    sched.set_costs(StepCosts(chunk_context_per_token=4.0))
    sched.add(
        Sequence("long", [5] * 300, SamplingParams(max_tokens=1, temperature=0), 5, 0, arrival_time=1.0)
    )
    sizes = []
    while sched.live_sequences():
        out = run_fake_step(sched)
        sizes.extend(out.num_scheduled_tokens)
    # the first chunk has no context (64 tokens); then chunk k at s pays s/4: 64 - 16 = 48 at s = 64, ...
    assert sizes[:3] == [64, 48, 36] and sum(sizes) == 300 and min(sizes) >= 1


def test_the_engine_fits_prices_on_its_steps_and_reports_budget_used(make_cpu_engine, monkeypatch):
    monkeypatch.setattr(step_cost, "MIN_STEPS", 40)
    monkeypatch.setattr(step_cost, "REFIT_EVERY", 20)
    engine = make_cpu_engine(max_num_batched_tokens=32)
    assert engine.scheduler.costs.decode_tokens == 1.0
    rng = random.Random(0)
    for i in range(24):  # enough steps for several fits: one may fail on a noisy machine
        engine.add_request(
            f"r{i}",
            [rng.randrange(3, 200) for _ in range(rng.randrange(5, 90))],
            SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
        )
    fitted = []
    real_set_costs = Scheduler.set_costs
    monkeypatch.setattr(Scheduler, "set_costs", lambda self, c: fitted.append(c) or real_set_costs(self, c))
    used = []
    while engine.has_unfinished_requests():
        engine.step()
        used.append(engine.stats()["last_step_budget_used"])
    assert max(used) <= 32 and min(used) >= 1
    assert fitted, "no prices were fitted on the engine's steps"
    assert engine.scheduler.costs == fitted[-1]


def test_an_engine_off_cost_awareness_keeps_plain_tokens(make_cpu_engine):
    engine = make_cpu_engine(attention_aware_chunks=False)
    assert engine.step_costs is None  # nothing timed or fitted in its steps
    engine.scheduler.set_costs(StepCosts(decode_tokens=9.0))
    assert engine.scheduler.costs == StepCosts() and engine.scheduler.context_per_token is None
