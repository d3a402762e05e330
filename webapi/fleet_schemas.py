"""Bodies of GET /models: each served model with its live workers, its queue per priority and its capacity."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class WorkerOut(BaseModel):
    """A live worker of a model, as it last announced itself."""

    id: str
    max_model_len: int
    capacity: int = Field(description="Jobs it holds at most (its engine's max_num_seqs and a reserve).")
    held: int = Field(description="Jobs it held at its last heartbeat.")
    heartbeat_age_seconds: float


class ServedModelOut(BaseModel):
    """A model the fleet serves."""

    id: str = Field(description="The name jobs give in `model`.")
    root: str = Field(description="The checkpoint behind the name (MODEL of its workers).")
    max_model_len: int
    status: Literal["ready", "no_live_worker"] = Field(
        description="`no_live_worker`: configured (MODEL, SERVED_MODELS) but no worker of it is live; its jobs are "
        "accepted and wait in its queue until one is."
    )
    queue: str = Field(description="Its Redis queue (`generate` for the default model).")
    queued: dict[str, int] = Field(description="Messages waiting in its queue, per priority (0 most urgent).")
    capacity: int = Field(description="Jobs its live workers hold at most, together.")
    workers: list[WorkerOut]
    default: bool = Field(description="Jobs that name no model run on it.")


class ServedModelList(BaseModel):
    models: list[ServedModelOut]
