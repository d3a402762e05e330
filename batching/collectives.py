"""One rank's process groups of a tensor-parallel engine (rank_group.py): "control", gloo on the CPU, for the
steps rank 0 broadcasts and agreements; "compute", for the model's all-reduces: NCCL on CUDA, the same gloo
group on the CPU. A collective that cannot complete raises RankFailure, with the reason `describe` gives."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class RankFailure(dist.DistBackendError):
    """A rank of a tensor-parallel engine died, failed or stopped answering; the engine cannot step again."""


class Collectives:
    """One rank's two process groups (module docstring). `describe` turns a failed collective into the reason
    RankFailure gives (rank 0: which rank went, and why)."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout: timedelta,
        describe: Callable[[BaseException], str],
    ):
        self.rank, self.world_size, self.describe = rank, world_size, describe
        # (torch's stubs lack the backends' collectives, which they have)
        self.control: Any = dist.ProcessGroupGloo(
            dist.PrefixStore("control", store), rank, world_size, timeout
        )
        self.compute: Any = self.control
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.compute = dist.ProcessGroupNCCL(
                dist.PrefixStore("compute", store), rank, world_size, options
            )

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over the ranks, in place (a rowwise layer's partial products)."""
        try:
            self.compute.allreduce([tensor]).wait()
        except RuntimeError as exc:
            raise RankFailure(self.describe(exc)) from exc

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` (on the CPU) into every rank's, in place."""
        try:
            self.control.broadcast(tensor, 0).wait()
        except RuntimeError as exc:
            raise RankFailure(self.describe(exc)) from exc

    def agree_min(self, values: list[int]) -> list[int]:
        """Each value's least over the ranks (pool sizes every rank can hold)."""
        tensor = torch.tensor(values, dtype=torch.long)
        try:
            self.control.allreduce([tensor], _min_options()).wait()
        except RuntimeError as exc:
            raise RankFailure(self.describe(exc)) from exc
        return tensor.tolist()


def _min_options() -> dist.AllreduceOptions:
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp(dist.ReduceOp.MIN)
    return options
