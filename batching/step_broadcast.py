"""What rank 0 of a tensor-parallel engine tells the other ranks before each forward: one int64 buffer.

Every rank runs every forward rank 0 runs (their rowwise layers sum over the ranks), on its own shard of the
model and its own KV cache under the same block ids. Rank 0 alone schedules and samples, so each message says
all a rank needs to run a step with the runner's own code:

    header [HEADER]: command, body length, rows T, segments S, decodes, swap-outs O, swap-ins I, table width W
    STEP body: swap_out [2 * O] | swap_in [2 * I] | input_ids [T] | positions [T] | slot_mapping [T]
               | q_lens [S] | num_computed_tokens [S] | block tables [S * W]
    REFERENCE body: token ids [T] (one sequence, run under the model's eager attention: the load-time probe)
    STOP: no body

A message is one broadcast of a buffer of `capacity` ints, whatever it holds; a longer one first sends its
header alone, and both sides grow the buffer to the same size before it is sent again.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from batching.model_runner import StepRows
from batching.sequence import Sequence

HEADER = 8
INITIAL_CAPACITY = 4096  # ints: a decode step of ~500 sequences of short contexts fits


class Command(enum.IntEnum):
    STEP = 1  # swaps, then a forward of the step's rows (no rows: swaps only)
    REFERENCE = 2  # a forward of one sequence under eager attention
    STOP = 3


@dataclass(slots=True, eq=False)
class RankSequence:
    """What a rank's runner reads of a scheduled sequence: its tokens computed before the step, its blocks."""

    num_computed_tokens: int
    block_table: list[int]


@dataclass(slots=True)
class Message:
    command: Command
    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    rows: StepRows | None  # STEP with a forward
    token_ids: list[int]  # REFERENCE


class StepBroadcast:
    """Both ends: rank 0 sends (`send_*`), the other ranks `receive`; `broadcast` is the control group's,
    in place from rank 0."""

    def __init__(self, broadcast: Callable[[torch.Tensor], None]):
        self.broadcast = broadcast
        self.buffer = torch.zeros(INITIAL_CAPACITY, dtype=torch.long)

    # --- rank 0

    def send_step(
        self,
        swap_out: list[tuple[int, int]],
        swap_in: list[tuple[int, int]],
        rows: StepRows | None,
        block_tables: np.ndarray | None,  # [S, W] the rows' sequences' block tables
    ) -> None:
        swaps = [_pairs(swap_out), _pairs(swap_in)]
        if rows is None or block_tables is None:
            self._send([Command.STEP, 0, 0, 0, 0, len(swap_out), len(swap_in), 0], swaps)
            return
        header = [
            Command.STEP, 0, len(rows.input_ids), len(rows.seqs), rows.num_decodes,
            len(swap_out), len(swap_in), block_tables.shape[1],
        ]  # fmt: skip
        computed = [seq.num_computed_tokens for seq in rows.seqs]
        body = [
            rows.input_ids,
            rows.positions,
            rows.slot_mapping,
            rows.q_lens,
            computed,
            block_tables.reshape(-1),
        ]
        self._send(header, swaps + body)

    def send_reference(self, token_ids: list[int]) -> None:
        self._send([Command.REFERENCE, 0, len(token_ids), 0, 0, 0, 0, 0], [token_ids])

    def send_stop(self) -> None:
        self._send([Command.STOP, 0, 0, 0, 0, 0, 0, 0], [])

    def _send(self, header: list[int], parts: list) -> None:
        header[1] = sum(len(part) for part in parts)
        if HEADER + header[1] > len(self.buffer):  # the header alone says how far both sides grow
            self.buffer[:HEADER] = torch.tensor(header)
            self.broadcast(self.buffer)
            self._grow(HEADER + header[1])
        buf = self.buffer.numpy()
        buf[:HEADER] = header
        at = HEADER
        for part in parts:
            buf[at : at + len(part)] = part
            at += len(part)
        self.broadcast(self.buffer)

    # --- the other ranks

    def receive(self) -> Message:
        self.broadcast(self.buffer)
        header = self.buffer[:HEADER].tolist()
        if HEADER + header[1] > len(self.buffer):
            self._grow(HEADER + header[1])
            self.broadcast(self.buffer)
        command, _, num_rows, num_segments, num_decodes, num_out, num_in, width = header
        body = self.buffer.numpy()[HEADER:]
        if command == Command.REFERENCE:
            return Message(Command.REFERENCE, [], [], None, body[:num_rows].tolist())
        if command != Command.STEP:
            return Message(Command(command), [], [], None, [])
        swap_out, at = _unpair(body, 0, num_out)
        swap_in, at = _unpair(body, at, num_in)
        if not num_rows:
            return Message(Command.STEP, swap_out, swap_in, None, [])
        lists = []
        for n in (num_rows, num_rows, num_rows, num_segments, num_segments):
            lists.append(body[at : at + n].tolist())
            at += n
        input_ids, positions, slot_mapping, q_lens, computed = lists
        tables = body[at : at + num_segments * width].reshape(num_segments, width).tolist()
        seqs = [RankSequence(c, table) for c, table in zip(computed, tables)]
        # the runner reads only num_computed_tokens and block_table of a step's sequences
        rows = StepRows(
            input_ids, positions, slot_mapping, [], [], cast("list[Sequence]", seqs), q_lens, num_decodes
        )
        return Message(Command.STEP, swap_out, swap_in, rows, [])

    def _grow(self, size: int) -> None:
        self.buffer = torch.zeros(max(size, 2 * len(self.buffer)), dtype=torch.long)


def _pairs(pairs: list[tuple[int, int]]) -> np.ndarray:
    return np.asarray(pairs, dtype=np.int64).reshape(-1)


def _unpair(body: np.ndarray, at: int, n: int) -> tuple[list[tuple[int, int]], int]:
    flat = body[at : at + 2 * n].tolist()
    return list(zip(flat[::2], flat[1::2])), at + 2 * n
