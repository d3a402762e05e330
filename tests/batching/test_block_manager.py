"""BlockManager in pure Python: unit cases and a hypothesis state machine over allocate / compute / free /
swap_out / swap_in. Every act happens whole or returns None and changes nothing."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from batching.block_manager import BlockManager, CachedPrefix, blocks_for
from batching.sampling_params import SamplingParams
from batching.sequence import Sequence

ROOT = Path(__file__).resolve().parents[2]


def new_seq(num_prompt_tokens: int, name: str = "s", tokens: list[int] | None = None) -> Sequence:
    tokens = tokens if tokens is not None else [5] * num_prompt_tokens
    return Sequence(name, tokens, SamplingParams(), priority=5, sample_seed=0)


# prompts of the machine below: prefixes of one text, a text of one repeated token, and texts that
# share the first one's beginning and then differ, so that prefixes are shared at every length
TEXT = [(7 * i) % 11 + 3 for i in range(30)]
PROMPT_KINDS = [
    lambda n: TEXT[:n],
    lambda n: [5] * n,
    lambda n: TEXT[: n // 2] + [99] * (n - n // 2),
]


def state(bm: BlockManager, seqs) -> tuple:
    return (
        list(bm.free_device),
        list(bm.free_host),
        [(list(s.block_table), list(s.host_block_table), s.num_computed_tokens) for s in seqs],
    )


@pytest.mark.parametrize("tokens,size,blocks", [(0, 4, 0), (1, 4, 1), (4, 4, 1), (5, 4, 2), (7, 1, 7)])
def test_blocks_for(tokens, size, blocks):
    assert blocks_for(tokens, size) == blocks


def test_allocate_takes_only_missing_blocks_and_none_changes_nothing():
    bm = BlockManager(num_device_blocks=4, num_host_blocks=0, block_size=4)
    a, b = new_seq(6, "a"), new_seq(9, "b")
    assert bm.allocate(a, 6) == [0, 1]
    a.num_computed_tokens = 6
    assert bm.allocate(a, 2) == []  # slots 6 and 7 are in block 1 already
    assert bm.max_tokens_allocatable(b) == 8
    before = state(bm, [a, b])
    assert not bm.can_allocate(b, 9) and bm.allocate(b, 9) is None
    assert state(bm, [a, b]) == before
    assert bm.allocate(b, 8) == [2, 3]
    bm.check_invariants([a, b])
    bm.free(a)
    assert sorted(bm.free_device) == [0, 1] and a.block_table == []
    bm.check_invariants([b])


def test_swap_out_copies_computed_blocks_and_frees_reserved_ones():
    bm = BlockManager(num_device_blocks=6, num_host_blocks=3, block_size=2)
    s = new_seq(5)
    bm.allocate(s, 5)  # blocks 0, 1, 2
    s.num_computed_tokens = 3  # KV in blocks 0 and 1; block 2 reserved, empty
    assert bm.swap_out(s) == [(0, 0), (1, 1)]
    assert s.block_table == [] and s.host_block_table == [0, 1]
    assert bm.num_free_device_blocks == 6 and bm.num_free_host_blocks == 1
    bm.check_invariants([s])
    t = new_seq(8, "t")
    bm.allocate(t, 8)
    t.num_computed_tokens = 8
    before = state(bm, [s, t])
    assert bm.swap_out(t) is None  # needs 4 host blocks, 1 free
    assert state(bm, [s, t]) == before
    bm.free(t)
    mapping = bm.swap_in(s)
    assert [h for h, _ in mapping] == [0, 1] and [d for _, d in mapping] == s.block_table
    assert s.host_block_table == [] and bm.num_free_host_blocks == 3
    bm.check_invariants([s])


def test_swap_in_none_changes_nothing():
    bm = BlockManager(num_device_blocks=3, num_host_blocks=3, block_size=1)
    s, t = new_seq(2, "s"), new_seq(3, "t")
    bm.allocate(s, 2)
    s.num_computed_tokens = 2
    bm.swap_out(s)
    bm.allocate(t, 2)  # one device block left, s needs two
    before = state(bm, [s, t])
    assert not bm.can_swap_in(s) and bm.swap_in(s) is None
    assert state(bm, [s, t]) == before


@pytest.mark.parametrize(
    "corrupt",
    ["double_owned", "leaked", "free_and_owned", "too_few_blocks", "both_pools", "shared_other_prefix"],
)
def test_check_invariants_catches_corruption(corrupt):
    bm = BlockManager(num_device_blocks=4, num_host_blocks=2, block_size=2)
    a, b = new_seq(3, "a"), new_seq(2, "b")
    bm.allocate(a, 3)
    bm.allocate(b, 2)
    a.num_computed_tokens, b.num_computed_tokens = 3, 2
    bm.check_invariants([a, b])
    if corrupt == "double_owned":
        b.block_table.append(a.block_table[0])
    elif corrupt == "leaked":
        bm.free_device.pop()
    elif corrupt == "free_and_owned":
        bm.free_device.add(a.block_table[0], None)
    elif corrupt == "too_few_blocks":
        a.num_computed_tokens = 5
    elif corrupt == "shared_other_prefix":  # b reads a's cached block, but b's tokens differ
        bm.cache_computed_blocks(a)
        b.token_ids[0] = 6
        bm.free(b)
        b.num_computed_tokens = 0
        bm.take_cached_prefix(b, CachedPrefix(device=a.block_table[:1]))
    else:
        a.host_block_table.append(bm.free_host.pop())
    with pytest.raises(AssertionError):
        bm.check_invariants([a, b])


def finished_seq(bm: BlockManager, tokens: list[int], priority: int, name: str) -> Sequence:
    """A sequence that computed `tokens` and finished: its full blocks stay cached, unreferenced."""
    seq = Sequence(name, tokens, SamplingParams(), priority=priority, sample_seed=0)
    bm.take_cached_prefix(seq, bm.find_cached_prefix(seq))
    bm.allocate(seq, len(tokens) - seq.num_computed_tokens)
    seq.num_computed_tokens = len(tokens)
    bm.free(seq)
    return seq


@pytest.mark.parametrize("contiguous", [False, True])  # placement takes only a class's oldest quarter
def test_eviction_takes_uncached_then_bulk_then_urgent_least_recently_used_first(contiguous):
    bm = BlockManager(num_device_blocks=8, num_host_blocks=0, block_size=2, contiguous=contiguous)
    urgent = finished_seq(bm, [10, 11, 12, 13], priority=0, name="urgent")  # 2 cached blocks
    bulk_old = finished_seq(bm, [20, 21, 22, 23], priority=9, name="bulk_old")
    bulk_new = finished_seq(bm, [30, 31, 32, 33], priority=9, name="bulk_new")
    assert bm.num_cached_device_blocks == 6 and bm.num_free_device_blocks == 8
    t = new_seq(16, "t")
    order = []
    for _ in range(8):
        order += bm.allocate(t, 2 * len(t.block_table) + 2 - t.num_computed_tokens)
        t.num_computed_tokens = 2 * len(t.block_table)
        cached = {
            name
            for name, s in (("urgent", urgent), ("bulk_old", bulk_old), ("bulk_new", bulk_new))
            if bm.find_cached_prefix(Sequence("q", s.token_ids + [1], SamplingParams(), 5, 0)).device
        }
        order.append(frozenset(cached))
    # 2 uncached blocks first; then bulk before urgent, the older bulk prompt first, a prefix's tail
    # before its head (a chain broken at its head is worth nothing anyway)
    still_cached = [c for c in order if isinstance(c, frozenset)]
    assert still_cached[1] == {"urgent", "bulk_old", "bulk_new"}
    assert still_cached[3] == {"urgent", "bulk_new"}
    assert still_cached[5] == {"urgent"}
    assert still_cached[7] == set()
    assert bm.num_evictions == 6


def test_contiguous_placement_gives_each_sequence_one_run_of_blocks():
    """Four sequences prefilled together, then decoding in lockstep: with placement each table is one run
    (each started where its expected length fits, then grew into the block after its last); without, the
    pool's order interleaves them."""
    for contiguous in (True, False):
        bm = BlockManager(num_device_blocks=40, num_host_blocks=0, block_size=2, contiguous=contiguous)
        seqs = [
            Sequence(f"s{i}", [5, 6, 7], SamplingParams(max_tokens=12), priority=5, sample_seed=0)
            for i in range(4)
        ]
        for seq in seqs:
            bm.allocate(seq, 3)
            seq.num_computed_tokens = 3
        for _ in range(11):
            bm.append_blocks([s for s in seqs if s.num_computed_tokens == 2 * len(s.block_table)])
            for seq in seqs:
                seq.num_computed_tokens += 1
        runs = [t == list(range(t[0], t[0] + len(t))) for t in (s.block_table for s in seqs)]
        assert all(len(s.block_table) == 7 for s in seqs)
        assert all(runs) if contiguous else not any(runs), [s.block_table for s in seqs]
        bm.check_invariants(seqs)


def test_contiguous_placement_keeps_the_eviction_tiers():
    """Placement takes only what the pool hands out next: no cached block while an uncached one is free, and
    cached KV of bulk work before urgent work's (the tiers' order of the test above)."""
    bm = BlockManager(num_device_blocks=8, num_host_blocks=0, block_size=2, contiguous=True)
    urgent = finished_seq(bm, [10, 11, 12, 13], priority=0, name="urgent")
    bulk = finished_seq(bm, [20, 21, 22, 23], priority=9, name="bulk")
    assert bm.num_cached_device_blocks == 4 and bm.num_free_device_blocks == 8

    def hits(seq) -> int:
        return len(bm.find_cached_prefix(Sequence("q", seq.token_ids + [1], SamplingParams(), 5, 0)).device)

    t = new_seq(16, "t")
    bm.allocate(t, 8)  # the 4 uncached blocks: nothing evicted
    assert bm.num_evictions == 0 and (hits(urgent), hits(bulk)) == (2, 2)
    t.num_computed_tokens = 8
    bm.allocate(t, 4)  # 2 more: bulk's
    assert bm.num_evictions == 2 and (hits(urgent), hits(bulk)) == (2, 0)
    t.num_computed_tokens = 12
    bm.allocate(t, 4)
    assert bm.num_evictions == 4 and hits(urgent) == 0
    bm.check_invariants([t])


class BlockManagerMachine(RuleBasedStateMachine):
    """Random sequences of acts on a small pool; a None answer must leave everything as it was."""

    seqs = Bundle("seqs")

    def __init__(self):
        super().__init__()
        self.bm = None
        self.live: list[Sequence] = []

    @precondition(lambda self: self.bm is None)
    @rule(
        device=st.integers(1, 12),
        host=st.integers(0, 8),
        block_size=st.integers(1, 4),
        caching=st.booleans(),
        contiguous=st.booleans(),
    )
    def make_pool(self, device, host, block_size, caching, contiguous):
        self.bm = BlockManager(device, host, block_size, enable_prefix_caching=caching, contiguous=contiguous)

    @precondition(lambda self: self.bm is not None)
    @rule(target=seqs, prompt=st.integers(1, 30), kind=st.integers(0, len(PROMPT_KINDS) - 1))
    def add(self, prompt, kind):
        seq = new_seq(prompt, f"s{len(self.live)}", PROMPT_KINDS[kind](prompt))
        self.live.append(seq)
        return seq

    @precondition(lambda self: self.bm is not None)
    @rule(seq=seqs)
    def start_on_cached_prefix(self, seq):
        """A sequence without KV takes the longest cached chain matching its tokens, if the pool allows."""
        if seq not in self.live or seq.block_table or seq.host_block_table or seq.num_computed_tokens:
            return
        bm = self.bm
        hit = bm.find_cached_prefix(seq)
        assert len(hit) * bm.block_size < seq.num_tokens, "no token left to compute"
        assert len(set(hit.device)) == len(hit.device) and len(set(hit.host)) == len(hit.host)
        if not bm.enable_prefix_caching:
            assert len(hit) == 0
        if bm.num_taken_by(hit) > bm.num_free_device_blocks:
            return
        refs = [bm.ref_counts[b] for b in hit.device]
        hits_before, host_hits_before = bm.num_hit_tokens, bm.num_host_hit_tokens
        loads_before = len(bm.loads)
        bm.take_cached_prefix(seq, hit)
        assert seq.block_table[: len(hit.device)] == hit.device and len(seq.block_table) == len(hit)
        assert seq.num_computed_tokens == len(hit) * bm.block_size
        assert [bm.ref_counts[b] for b in hit.device] == [r + 1 for r in refs]
        assert bm.num_hit_tokens == hits_before + seq.num_computed_tokens
        assert bm.num_host_hit_tokens == host_hits_before + len(hit.host) * bm.block_size
        # host hits are copied back into the blocks that follow the device ones
        assert bm.loads[loads_before:] == list(zip(hit.host, seq.block_table[len(hit.device) :], strict=True))
        assert set(hit.host) <= set(bm.host_released), "a host block read this step is reusable"
        # that each block of the chain holds this sequence's prefix is checked by check_invariants

    @precondition(lambda self: self.bm is not None)
    @rule(seq=seqs)
    def cache_computed(self, seq):
        if seq in self.live and not seq.host_block_table:
            self.bm.cache_computed_blocks(seq)

    @precondition(lambda self: self.bm is not None)
    @rule(seq=seqs, n=st.integers(0, 12))
    def allocate(self, seq, n):
        if seq not in self.live or seq.host_block_table:
            return
        before = state(self.bm, self.live)
        need = self.bm.num_new_blocks(seq, n)
        can = self.bm.can_allocate(seq, n)
        got = self.bm.allocate(seq, n)
        if got is None:
            assert not can and need > self.bm.num_free_device_blocks
            assert state(self.bm, self.live) == before
        else:
            assert can and len(got) == need and seq.block_table[len(seq.block_table) - need :] == got
            assert len(seq.block_table) * self.bm.block_size >= seq.num_computed_tokens + n

    @precondition(lambda self: self.bm is not None)
    @rule(seq=seqs, n=st.integers(1, 12))
    def compute(self, seq, n):
        """The runner filled slots: KV now exists for up to n more tokens that have blocks."""
        if seq in self.live and not seq.host_block_table:
            room = len(seq.block_table) * self.bm.block_size - seq.num_computed_tokens
            seq.num_computed_tokens += min(n, room)

    @precondition(lambda self: self.bm is not None)
    @rule(seq=consumes(seqs))
    def free(self, seq):
        if seq not in self.live:
            return
        # blocks shared with other sequences stay theirs
        owned = sum(self.bm.ref_counts[b] == 1 for b in seq.block_table), len(seq.host_block_table)
        free = self.bm.num_free_device_blocks, self.bm.num_free_host_blocks
        self.bm.free(seq)
        self.live.remove(seq)
        assert (self.bm.num_free_device_blocks, self.bm.num_free_host_blocks) == (
            free[0] + owned[0],
            free[1] + owned[1],
        )
        assert seq.block_table == [] and seq.host_block_table == []

    @precondition(lambda self: self.bm is not None)
    @rule(seq=seqs)
    def swap_out(self, seq):
        if seq not in self.live or seq.host_block_table or not seq.num_computed_tokens:
            return
        before = state(self.bm, self.live)
        table = list(seq.block_table)
        private = [b for b in table if self.bm.ref_counts[b] == 1]
        used = blocks_for(seq.num_computed_tokens, self.bm.block_size)
        can = used <= len(self.bm.free_host)
        mapping = self.bm.swap_out(seq)
        if mapping is None:
            assert not can and used > len(self.bm.free_host)
            assert state(self.bm, self.live) == before
        else:
            assert can and [d for d, _ in mapping] == table[:used]
            assert [h for _, h in mapping] == seq.host_block_table and seq.block_table == []
            assert set(private) <= set(self.bm.free_device)
            assert all(self.bm.ref_counts[b] > 0 for b in set(table) - set(private))

    @precondition(lambda self: self.bm is not None)
    @rule(seq=seqs)
    def swap_in(self, seq):
        if seq not in self.live or not seq.host_block_table:
            return
        before = state(self.bm, self.live)
        host = list(seq.host_block_table)
        can = self.bm.can_swap_in(seq)
        mapping = self.bm.swap_in(seq)
        if mapping is None:
            assert not can and len(host) > self.bm.num_free_device_blocks
            assert state(self.bm, self.live) == before
        else:
            assert can and [h for h, _ in mapping] == host and [d for _, d in mapping] == seq.block_table
            # free, reusable from the next step on (the runner reads them after this step's swap-outs)
            assert seq.host_block_table == [] and set(host) <= set(self.bm.host_released)

    @precondition(lambda self: self.bm is not None)
    @rule()
    def start_step(self):
        """The runner copied this step's blocks: offloads into distinct host blocks, loads into distinct
        device blocks, no host block both written and read."""
        offloads, loads = self.bm.take_copies()
        assert len({h for _, h in offloads}) == len(offloads) and len({d for _, d in loads}) == len(loads)
        assert not {h for _, h in offloads} & {h for h, _ in loads}
        free = self.bm.num_free_host_blocks
        self.bm.start_step()
        assert not self.bm.host_released and len(self.bm.free_host) == free

    @invariant()
    def blocks_are_free_or_owned_once(self):
        if self.bm is not None:
            self.bm.check_invariants(self.live)
            assert 0.0 <= self.bm.device_usage() <= 1.0 and 0.0 <= self.bm.host_usage() <= 1.0

    def teardown(self):
        if self.bm is None:
            return
        for seq in list(self.live):
            self.bm.free(seq)
        assert self.bm.num_free_device_blocks == self.bm.num_device_blocks
        assert self.bm.num_free_host_blocks == self.bm.num_host_blocks


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize(
    "module", ["block_manager", "free_pool", "scheduler", "sequence", "sampling_params", "config"]
)
def test_scheduling_modules_do_not_import_torch(module):
    """The scheduling modules move block ids and counts only, never tensors: cheap to test, no torch."""
    tree = ast.parse((ROOT / "batching" / f"{module}.py").read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    imported |= {
        (node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
    }
    assert "torch" not in imported
