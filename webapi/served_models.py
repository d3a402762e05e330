"""GET /v1/models: the names this server answers to (MODEL and MODEL_ALIASES), in OpenAI's shape with vLLM's
`root` (the model behind the name) and `max_model_len`."""

from __future__ import annotations

import time

from flask import Blueprint

from webapi.auth import require_api_key
from webapi.extensions import services
from webapi.openai_schemas import ModelCard, ModelList
from webapi.spec import endpoint

bp = Blueprint("served_models", __name__, url_prefix="/v1")
bp.before_request(require_api_key)
STARTED = int(time.time())  # a model's `created`: when this process began serving it


@bp.get("/models")
@endpoint(responses={200: ModelList})
def list_models():
    """The served model and its aliases, with max_model_len (vLLM's fields)."""
    settings = services().settings
    names = [settings.model, *sorted(settings.served_models() - {settings.model})]
    cards = [
        ModelCard(id=name, created=STARTED, root=settings.model, max_model_len=settings.max_model_len)
        for name in names
    ]
    return ModelList(data=cards).model_dump()
