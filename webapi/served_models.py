"""The models the fleet serves (webapi/fleet.py): GET /v1/models and /v1/models/<id> in OpenAI's shape with
vLLM's `root` (the model behind the name) and `max_model_len`, and the native GET /models with each model's live
workers, queue depth per priority and capacity."""

from __future__ import annotations

import time

from flask import Blueprint

from contract.dispatch import model_queue, queue_lengths
from webapi.auth import require_api_key
from webapi.errors import APIError
from webapi.extensions import services
from webapi.fleet import FleetModel
from webapi.fleet_schemas import ServedModelList, ServedModelOut, WorkerOut
from webapi.openai_schemas import ModelCard, ModelList
from webapi.spec import endpoint

bp = Blueprint("served_models", __name__)  # /v1/models (OpenAI's) and /models (genq's)
bp.before_request(require_api_key)
STARTED = int(time.time())  # a model's `created`: when this process began serving it


@bp.get("/v1/models")
@endpoint(responses={200: ModelList})
def list_models():
    """Every served model and the default model's aliases, with max_model_len (vLLM's fields)."""
    return ModelList(data=model_cards()).model_dump()


@bp.get("/v1/models/<path:model_id>")
@endpoint(responses={200: ModelCard})
def retrieve_model(model_id: str):
    """One served model (OpenAI's client.models.retrieve); 404 model_not_found naming the served ones."""
    found = next((card for card in model_cards() if card.id == model_id), None)
    if found is None:
        names = ", ".join(f"`{card.id}`" for card in model_cards())
        raise APIError(
            404, "model_not_found", f"model: the model `{model_id}` does not exist here; served: {names}"
        )
    return found.model_dump()


@bp.get("/models")
@endpoint(responses={200: ServedModelList})
def fleet_models():
    """Every served model with its live workers, its queue per priority and its capacity."""
    found = services()
    models = list(found.fleet.models().values())
    queues = {m.name: model_queue(found.settings, m.name) for m in models}
    lengths = queue_lengths(found.fleet.redis, found.settings, queues.values())
    default = found.settings.fleet_default_model()
    return ServedModelList(
        models=[
            served_model_out(m, queues[m.name], lengths[queues[m.name]], m.name == default) for m in models
        ]
    ).model_dump()


def model_cards() -> list[ModelCard]:
    """A card per served model, then one per alias of the default model."""
    fleet = services().fleet
    default = fleet.default()
    cards = [
        ModelCard(id=m.name, created=STARTED, root=m.model, max_model_len=m.max_model_len)
        for m in fleet.models().values()
    ]
    for alias in sorted(services().settings.alias_names() - fleet.models().keys()):
        cards.append(
            ModelCard(id=alias, created=STARTED, root=default.model, max_model_len=default.max_model_len)
        )
    return cards


def served_model_out(model: FleetModel, queue: str, lengths: list[int], default: bool) -> ServedModelOut:
    now = time.time()
    return ServedModelOut(
        id=model.name,
        root=model.model,
        max_model_len=model.max_model_len,
        status="ready" if model.live else "no_live_worker",
        queue=queue,
        queued={str(p): n for p, n in enumerate(lengths)},
        capacity=model.capacity,
        workers=[
            WorkerOut(
                id=w.worker,
                max_model_len=w.max_model_len,
                capacity=w.capacity,
                held=w.held,
                heartbeat_age_seconds=round(max(0.0, now - w.heartbeat), 3),
            )
            for w in model.workers
        ],
        default=default,
    )
