"""In-class preemption through a real worker (issue 44): under SCHEDULING_POLICY=preemptive the worker holds more
jobs than its engine's slots (worker_capacity: 3x max_num_seqs by default), so short jobs sent behind a long one
of their priority reach the engine, where the long one, past its first quantum, yields its slot to them (its KV
swapped to host memory) and resumes after; its output is the one it makes alone. Under predicted the worker holds
slots + 2 and nothing yields within a class: the long job ends first."""

from __future__ import annotations

import pytest

from batching.scheduler import QUANTUM_TOKENS
from tests.workers.test_within_class import LONG, api, finished, worker


def test_the_worker_holds_three_times_its_slots_under_preemptive(settings):
    settings = settings.replace(scheduling_policy="preemptive", worker_reserve=None)
    assert settings.worker_capacity(8) == 24
    assert settings.replace(scheduling_policy="predicted").worker_capacity(8) == 10
    assert settings.replace(worker_reserve=1).worker_capacity(8) == 9  # a reserve set is kept


@pytest.mark.parametrize("policy", ["preemptive", "predicted"])
def test_short_jobs_of_its_class_overtake_a_running_long_one(
    policy, settings, new_key, sessions, redis_client, tmp_path
):
    """One slot. A long job runs past its first quantum; two short ones of its priority are sent: under
    preemptive they end before it, and it makes the same tokens as a long job run alone; under predicted they
    wait for it."""
    log = tmp_path / "worker.log"
    with (
        api(settings, new_key, log, policy, max_num_seqs=1, reserve=None) as stack,
        worker(stack.settings, log),
    ):
        alone = stack.wait(stack.submit(**LONG, max_tokens=1000))
        long = stack.submit(**LONG, max_tokens=1000)
        stack.wait(long, until=lambda j: len(j["output"]["token_ids"]) > QUANTUM_TOKENS + 8)
        shorts = [stack.submit(**LONG, max_tokens=4) for _ in range(2)]
        done = {job_id: stack.wait(job_id) for job_id in [long, *shorts]}
    assert all(job["status"] == "succeeded" for job in done.values()), done
    ends = {job_id: finished(job) for job_id, job in done.items()}
    if policy == "preemptive":
        assert max(ends[s] for s in shorts) < ends[long], ends
        assert done[long]["output"]["token_ids"] == alone["output"]["token_ids"]
    else:
        assert ends[long] < min(ends[s] for s in shorts), ends
