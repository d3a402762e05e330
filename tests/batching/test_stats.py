"""stats(): queue counts, device and host KV usage, preemptions, blocks swapped out and in, recomputed
tokens, and the step counters, each moving as the requests do."""

from __future__ import annotations

import pytest

from tests.batching.conftest import greedy, random_prompts, run_to_completion


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_stats_follow_one_preemption(make_cpu_engine, mode):
    """stats(): queue counts, KV usage, preemptions, swapped blocks and recomputed tokens move as expected."""
    engine = make_cpu_engine(
        block_size=2,
        num_device_blocks=50,
        num_host_blocks=20 if mode == "swap" else 0,
        max_num_seqs=1,
        preemption_mode=mode,
    )
    low, urgent = random_prompts(52, [7, 5])
    s = engine.stats()
    assert (s["num_running"], s["num_waiting"], s["num_swapped"]) == (0, 0, 0)
    assert s["device_kv_usage"] == s["host_kv_usage"] == 0
    engine.add_request("low", low, greedy(6), priority=9)
    assert engine.stats()["num_waiting"] == 1
    engine.step()
    engine.step()  # 7 prompt tokens + 1 decode computed: 4 blocks
    s = engine.stats()
    assert (s["num_running"], s["num_waiting"], s["num_swapped"]) == (1, 0, 0)
    assert s["device_kv_usage"] == pytest.approx(4 / 50)  # 7 prompt tokens + 1 decoded: 4 blocks of 2
    engine.add_request("urgent", urgent, greedy(3), priority=0)
    engine.step()
    s = engine.stats()
    assert s["num_preemptions"] == 1 and s["num_running"] == 1
    if mode == "swap":
        assert (s["num_waiting"], s["num_swapped"]) == (0, 1)
        assert s["num_blocks_swapped_out"] == 4 and s["num_recomputed_tokens"] == 0
        assert s["host_kv_usage"] == pytest.approx(4 / 20)
    else:
        assert (s["num_waiting"], s["num_swapped"]) == (1, 0)
        assert s["num_blocks_swapped_out"] == 0 and s["num_recomputed_tokens"] == 8
        assert s["host_kv_usage"] == 0
    run_to_completion(engine)
    s = engine.stats()
    assert (s["num_running"], s["num_waiting"], s["num_swapped"]) == (0, 0, 0)
    assert s["device_kv_usage"] == s["host_kv_usage"] == 0
    assert s["num_blocks_swapped_in"] == (4 if mode == "swap" else 0)
    assert s["num_preemptions"] == 1


def test_counters_follow_the_work(make_cpu_engine):
    engine = make_cpu_engine(block_size=4, num_device_blocks=40, num_host_blocks=0, max_num_batched_tokens=8)
    s = engine.stats()
    assert (
        s["num_steps"] == s["num_generated_tokens"] == s["num_prompt_tokens_computed"] == 0
    )  # no warm-up left
    a, b, c = random_prompts(53, [5, 7, 3])
    engine.add_request("a", a, greedy(3))
    engine.add_request("b", b, greedy(4))
    out = engine.step()  # 8 tokens of budget: a's 5 prompt tokens and 3 of b's 7
    s = engine.stats()
    assert s["last_step_num_tokens"] == 8 and s["last_step_num_seqs"] == 2
    assert [o.request_id for o in out] == ["a"]
    engine.add_request("c", c, greedy(5))
    engine.abort("c")
    steps = 1
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    s = engine.stats()
    assert s["num_steps"] == steps
    assert s["num_generated_tokens"] == 3 + 4
    assert s["num_prompt_tokens_computed"] == 5 + 7
    assert s["num_aborted"] == 1
    assert s["num_preemptions"] == s["num_recomputed_tokens"] == 0
    assert s["step_time_s"] > 0
