"""The engine's short cuts on the host (issue 38) give what the general paths give: a step of decodes packed by
columns, from scratch or from the step before (model_runner.ModelRunner._decode_step), and the argmax taken by
numpy (sampler.argmax)."""

from __future__ import annotations

import pytest
import torch

from batching import SamplingParams
from batching.model_runner import FEW_DECODES
from batching.sampler import argmax
from tests.batching.conftest import random_prompts


def packed(batch) -> dict:
    """A decode step's ModelInput as lists; each row's block table up to its context (past it: never read)."""
    group = batch.attn.decodes[0]
    lens = group.context_lens.tolist()
    width = group.width
    tables = group.block_ids.view(-1, width).tolist()
    bs = batch.attn.kv_cache.block_size
    return dict(
        input_ids=batch.input_ids.tolist(),
        positions=batch.position_ids.tolist(),
        logits_rows=batch.logits_indices.tolist(),
        slots=batch.attn.slot_mapping.tolist(),
        lens=lens,
        width=width,
        tables=[row[: -(-n // bs)] for row, n in zip(tables, lens, strict=True)],
        seqs=[seq.req_id for seq in batch.sample_seqs],
    )


@pytest.mark.parametrize("width", [FEW_DECODES - 1, FEW_DECODES + 4])
def test_a_decode_step_packed_by_columns_is_the_general_paths(make_cpu_engine, width):
    """Every step of decodes only, packed by `_decode_step` (few sequences in Python; many in numpy, from the
    step before while its sequences stay the same), equals `prepare(step_rows(...))`'s rows: ids, positions,
    slots, logits rows, contexts and block tables. Prompts of many lengths cross into new blocks at different
    steps, requests end at different lengths, one arrives and one is cancelled midway (the set changes).
    Without the rows' refresh at a block boundary, the slots and tables of the step before fail this."""
    engine = make_cpu_engine(block_size=4, max_num_seqs=width + 1, max_num_batched_tokens=256)
    runner = engine.runner
    assert runner._decodes_by_columns
    prompts = random_prompts(31, [3 + (7 * i) % 13 for i in range(width + 1)])
    for i in range(width):
        engine.add_request(
            f"r{i}", prompts[i], SamplingParams(max_tokens=12 + i % 9, temperature=0, ignore_eos=True)
        )
    compared, from_last = [], []
    packer = runner._decode_step

    def checked(seqs, last=None):
        from_last.append(last is not None and last.seqs == seqs)
        batch = packer(seqs, last)
        got = packed(batch)  # before the general path, which brings the tables' rows up to date itself
        sched_seqs = list(seqs)
        from batching.scheduler import SchedulerOutput

        sched = SchedulerOutput(seqs=sched_seqs, num_scheduled_tokens=[1] * len(seqs), num_decodes=len(seqs))
        assert got == packed(runner.prepare(sched, runner.step_rows(sched, pending=False)))
        compared.append(len(seqs))
        return batch

    runner._decode_step = checked
    step = 0
    while engine.has_unfinished_requests():
        if step == 6:
            engine.add_request(
                "late", prompts[width], SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
            )
        if step == 9:
            assert engine.abort("r1")
        engine.step()
        engine.check_invariants()
        step += 1
    assert len(compared) > 10
    if width >= FEW_DECODES:
        assert sum(from_last) > 5  # the steady state was taken from the step before
        assert any(n >= FEW_DECODES for n in compared)


def test_numpy_argmax_is_torchs():
    """The first of equal maxima (-0 and +0 equal), a NaN before every number, in float32 and float64, and in
    bfloat16 and float16 widened to float32."""
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        logits = torch.randint(0, 4, (64, 259), generator=g).to(dtype) - 3  # many ties
        logits[4, :] = -1.0
        logits[4, 30], logits[4, 31] = -0.0, 0.0
        logits[5, 17] = float("nan")
        logits[6, :] = float("-inf")
        logits[7, 200] = float("inf")
        got = argmax(logits)
        assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(dim=-1)), dtype
    assert torch.equal(argmax(torch.zeros(0, 259)), torch.zeros(0, dtype=torch.int64))
