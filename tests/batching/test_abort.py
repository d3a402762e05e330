"""Abort anywhere (waiting, running, mid-prefill, swapped, waiting for recompute) frees device and host
blocks at once, reports finish_reason "abort" once, and the other requests still finish exactly."""

from __future__ import annotations

import pytest

from batching.sequence import PENDING_TOKEN, SequenceStatus
from tests.batching.conftest import greedy, random_prompts, run_to_completion

OTHERS_MAX = 10


@pytest.fixture(scope="module")
def engines(make_engine):
    common = dict(block_size=2, num_device_blocks=60, max_num_batched_tokens=8, max_num_seqs=3)
    return {
        "swap": make_engine(num_host_blocks=40, preemption_mode="swap", **common),
        "recompute": make_engine(num_host_blocks=0, preemption_mode="recompute", **common),
    }


def put_victim_in(engine, where: str, prompts) -> None:
    """Start two ordinary requests and the victim, and step until the victim is `where`."""
    x, y, victim = prompts
    seqs = engine.requests
    if where == "waiting":
        engine.add_request("x", x, greedy(OTHERS_MAX), priority=5)
        engine.add_request("y", y, greedy(OTHERS_MAX), priority=5)
        engine.add_request("z", victim, greedy(OTHERS_MAX), priority=5)
        engine.add_request("victim", victim, greedy(20), priority=5)  # 3 slots taken: it waits
        engine.step()
        engine.step()
        assert seqs["victim"].status == SequenceStatus.WAITING
        return
    if where == "mid_prefill":
        engine.add_request("victim", victim * 3, greedy(20), priority=5)
        engine.step()
        assert 0 < seqs["victim"].num_computed_tokens < len(victim) * 3
        engine.add_request("x", x, greedy(OTHERS_MAX), priority=5)
        engine.add_request("y", y, greedy(OTHERS_MAX), priority=5)
        engine.step()
        assert seqs["victim"].status == SequenceStatus.RUNNING and not seqs["victim"].is_decoding
        return
    engine.add_request("victim", victim, greedy(20), priority=9)
    engine.add_request("x", x, greedy(OTHERS_MAX), priority=5)
    engine.step()
    engine.step()
    engine.step()
    assert seqs["victim"].is_decoding and seqs["victim"].num_output_tokens >= 1
    if where in ("swapped", "waiting_for_recompute"):
        engine.add_request("y", y, greedy(OTHERS_MAX), priority=0)
        engine.step()
        engine.add_request("z", victim, greedy(OTHERS_MAX), priority=0)  # the slots are full: preempts
        engine.step()
        expected = SequenceStatus.SWAPPED if where == "swapped" else SequenceStatus.WAITING
        assert seqs["victim"].status == expected and seqs["victim"].num_preemptions == 1
        assert seqs["victim"].num_output_tokens >= 1
    else:
        engine.add_request("y", y, greedy(OTHERS_MAX), priority=5)


@pytest.mark.parametrize(
    "where,mode",
    [
        ("waiting", "swap"),
        ("running", "swap"),
        ("mid_prefill", "swap"),
        ("swapped", "swap"),
        ("waiting_for_recompute", "recompute"),
    ],
)
def test_abort_frees_blocks_at_once(engines, llama_path, reference, where, mode):
    engine = engines[mode]
    bm = engine.block_manager
    prompts = random_prompts(60, [6, 9, 11])
    put_victim_in(engine, where, prompts)
    victim = engine.requests["victim"]
    others = [s for s in engine.scheduler.live_sequences() if s is not victim]
    held_by_others = sum(len(s.block_table) for s in others), sum(len(s.host_block_table) for s in others)
    assert (
        victim.block_table
        or victim.host_block_table
        or where == "waiting"
        or where == "waiting_for_recompute"
    )
    # the tokens on the host (with async scheduling the last may still be on the device: dropped)
    tokens_so_far = [t for t in victim.output_token_ids if t != PENDING_TOKEN]

    assert engine.abort("victim") is True
    # freed now, not at the next step
    assert bm.num_free_device_blocks == bm.num_device_blocks - held_by_others[0]
    assert bm.num_free_host_blocks == bm.num_host_blocks - held_by_others[1]
    assert not victim.block_table and not victim.host_block_table
    assert victim not in engine.scheduler.live_sequences()
    engine.check_invariants()
    assert engine.abort("victim") is False  # already gone

    outputs = [o for o in engine.step() if o.request_id == "victim"]
    assert len(outputs) == 1
    out = outputs[0]
    assert out.finished and out.finish_reason == "abort"
    assert out.token_ids == tokens_so_far and out.finish_time is not None
    results = run_to_completion(engine)
    assert "victim" not in results  # reported once only
    x, y, z = prompts
    expected = {"x": x, "y": y, "z": z}
    for req_id, out in results.items():
        assert out.token_ids == reference(llama_path, tuple(expected[req_id]), OTHERS_MAX), req_id
        assert out.finish_reason == "length"


def test_abort_unknown_or_finished_request(engines):
    engine = engines["swap"]
    assert engine.abort("never-added") is False
    engine.add_request("done", [5, 6, 7], greedy(2))
    run_to_completion(engine)
    assert engine.abort("done") is False
    assert not engine.has_unfinished_requests()


def test_abort_before_first_step_reports_and_leaves_engine_idle(engines):
    engine = engines["recompute"]
    engine.add_request("a", [5, 6, 7], greedy(4))
    assert engine.abort("a") is True
    assert engine.has_unfinished_requests()  # until the abort is reported
    outs = engine.step()
    assert [(o.request_id, o.finish_reason, o.token_ids) for o in outs] == [("a", "abort", [])]
    assert not engine.has_unfinished_requests()
    assert engine.stats()["num_waiting"] == 0
