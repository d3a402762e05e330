"""The models the fleet serves, as the API sees them: the workers' announcements in Redis (contract/fleet.py), the
default model (MODEL, under its served name, and its MODEL_ALIASES) and SERVED_MODELS.

A request's `model` is resolved here: a name a live worker serves, or one configured, is served (a configured one
with no live worker is accepted, and its jobs wait in its queue); any other is 404 model_not_found naming the
served ones. A served model's limits (its checkpoint, max_model_len) are its live workers' (the smallest
max_model_len among them), or the settings' while none is live. An API process reads the announcements at most
once per `max_age` seconds: a worker that just started is known to it within a second.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import redis

from contract.fleet import Announcement, live_workers
from contract.settings import ApiSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FleetModel:
    """One served model: its name, what runs it, its limits, and its live workers."""

    name: str
    model: str  # the checkpoint: a Hugging Face id, a path, or tiny-llama (its tokenizer's too)
    max_model_len: int
    workers: tuple[Announcement, ...]
    configured: bool  # MODEL or SERVED_MODELS name it (it is served with no live worker)

    @property
    def live(self) -> bool:
        return bool(self.workers)

    @property
    def capacity(self) -> int:
        """Jobs its live workers hold at most, together."""
        return sum(worker.capacity for worker in self.workers)


class ModelNotServed(LookupError):
    """A `model` the fleet does not serve; its message names the served ones."""

    def __init__(self, name: str, served: list[str]):
        self.name, self.served = name, served
        names = ", ".join(f"`{n}`" for n in served)
        super().__init__(f"model: the model `{name}` does not exist here; this server serves {names}")


class Fleet:
    def __init__(self, settings: ApiSettings, client: redis.Redis, max_age: float = 1.0):
        self._settings, self.redis, self._max_age = settings, client, max_age
        self._lock = threading.Lock()
        self._read_at = -float("inf")
        self._models: dict[str, FleetModel] = {}

    def models(self) -> dict[str, FleetModel]:
        """Every served model by name, the default first, then the others by name."""
        with self._lock:
            if time.monotonic() - self._read_at >= self._max_age:
                self._models = self._read()
                self._read_at = time.monotonic()
            return self._models

    def names(self) -> frozenset[str]:
        """The names a request's `model` may give: the served models' and MODEL_ALIASES."""
        return frozenset(self.models()) | self._settings.alias_names()

    def default(self) -> FleetModel:
        return self.models()[self._settings.fleet_default_model()]

    def resolve(self, name: str | None) -> FleetModel:
        """The served model `name` names (None or an alias: the default); ModelNotServed for any other name."""
        settings = self._settings
        if name is None or name in settings.alias_names():
            return self.default()
        found = self.models().get(name)
        if found is None:
            raise ModelNotServed(name, sorted(self.names()))
        return found

    def _read(self) -> dict[str, FleetModel]:
        settings = self._settings
        try:
            workers = live_workers(self.redis, settings.redis_key_prefix)
        except redis.RedisError as exc:  # configured models stay served; their jobs wait in Redis's absence
            log.warning("fleet: the workers' announcements cannot be read (%s)", exc.__class__.__name__)
            workers = []
        by_name: dict[str, list[Announcement]] = {}
        for worker in sorted(workers, key=lambda w: w.worker):
            by_name.setdefault(worker.name, []).append(worker)
        configured = settings.configured_models()
        default = settings.fleet_default_model()
        names = [default, *sorted((configured.keys() | by_name.keys()) - {default})]
        models = {}
        for name in names:
            live = tuple(by_name.get(name, ()))
            models[name] = FleetModel(
                name=name,
                model=live[0].model if live else configured[name],
                max_model_len=min(w.max_model_len for w in live) if live else settings.max_model_len,
                workers=live,
                configured=name in configured,
            )
        return models
