"""Non-attention layers (Mamba, Mamba-2, gated delta nets, short convolutions) run per sequence from
genq's state cache, through transformers' own layer code.

transformers' state layers read and write their state through the cache object they are handed
(`cache_params` or `past_key_values`): `get_conv_state`, `update_conv_state`, `get_recurrent_state`,
`update_recurrent_state`, `has_previous_state`. genq packs a step's sequences into one row of
tokens, which such a layer would run as one sequence, so at load each of them is wrapped
(`install`): in a step, the wrapper splits the packed rows by sequence and calls the layer's own
forward with a cache of transformers' own class (`LinearAttentionLayer`) that holds the states of
just those sequences, gathered from their slots (state_cache.py), then writes what the layer left
there back to the slots:

- every token runs through the path `generate()` runs it through: the prompt through the layer's
  whole-sequence path, each generated token through its single-token path, one call per token (the
  two paths round differently, in some layers far beyond float64's rounding: Nemotron-H's Mamba-2
  mixer scans in float32 and keeps its state so). Tokens generated before that a step computes
  again (a sequence preempted for recomputation, a resume from persisted tokens) therefore run one
  per call too;
- a sequence with no state yet (the first chunk of its prompt) runs that chunk in one call, from an
  empty cache, as `generate()` runs a prompt;
- a later chunk of a prompt continues from its state in one call when the layer does that exactly
  (`resumes_chunks`, checked at load); in a layer that does not, it runs one token per call, which
  is how such layers (Mamba's) carry a state; the scheduler never leaves a lone last prompt token
  for a chunk of its own (one token would take the single-token path);
- tokens that run one per call do so in batched calls, one per token position across the step's
  sequences ("waves"), after the whole-sequence calls.

Outside a step (the reference forward of the load-time check, a plain `model(...)` call) the layer
runs as transformers wrote it. In the load-time shape forward the wrapper records the shape of
each state the layer keeps (`geometry`), which sizes the slots.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from batching.attention import current_step
from batching.state_cache import StateCache, StateGeometry, StateSpec
from batching.state_step import StateStep

CACHE_CALLS = ("get_conv_state", "get_recurrent_state", "update_conv_state", "update_recurrent_state")
CACHE_ARGS = ("cache_params", "past_key_values")
# a chunk resumed from the state vs the whole sequence at once: max |diff| / max(1, max |whole|). A
# layer that drops the state errs by 0.1 to 1; one that keeps it by rounding (some compute their
# scans partly in float32: ~1e-8 in a float64 model)
RESUME_TOLERANCE = {torch.float64: 1e-5, torch.float32: 1e-3}


class StateLayer:
    """The wrapper around one state layer's forward (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, states_per_layer: int):
        self.module = module
        self.layer_idx = int(module.layer_idx)  # type: ignore[arg-type]
        self.num_states = states_per_layer
        self.original = module.forward
        self.signature = inspect.signature(self.original)
        names = list(self.signature.parameters)
        self.hidden_arg = names[0]
        self.var_keyword = next(
            (p.name for p in self.signature.parameters.values() if p.kind is p.VAR_KEYWORD), None
        )
        self.cache_arg = next(a for a in CACHE_ARGS if a in names)
        self.recorded: list[StateSpec] = []  # by the shape forward
        self.previous_flags: dict[int, bool] = {}  # has_previous_state after a first call
        self.resumes_chunks = False  # found by the shape forward (_check_resume)
        self.unsupported: str | None = None  # why genq cannot split its calls by sequence (shape forward)
        module.forward = self

    def __call__(self, *args, **kwargs):
        step = current_step()
        if step is None:  # not a genq step: transformers' own behaviour
            return self.original(*args, **kwargs)
        bound = self.signature.bind(*args, **kwargs)
        arguments = dict(bound.arguments)
        if self.var_keyword is not None:
            arguments.update(arguments.pop(self.var_keyword, None) or {})
        hidden = arguments.pop(self.hidden_arg)
        arguments.pop(self.cache_arg, None)
        states: StateStep | None = getattr(step, "states", None)
        if states is None:
            if hasattr(step, "slot_mapping"):
                raise RuntimeError(
                    f"layer {self.layer_idx} keeps a state but the step carries no state slots"
                )
            return self._record(hidden, arguments)  # the load-time shape forward
        return self._run(hidden, arguments, states)

    def _record(self, hidden: torch.Tensor, arguments: dict):
        layer, cache = self._cache(None)
        out = self.original(hidden, **{self.cache_arg: cache}, **arguments)
        self.recorded = []
        for i in range(self.num_states):
            for kind, tensors in (("conv", layer.conv_states), ("recurrent", layer.recurrent_states)):
                t = tensors.get(i)
                if t is not None:
                    self.recorded.append(StateSpec(self.layer_idx, kind, i, tuple(t.shape[1:]), t.dtype))
        self.previous_flags = dict(layer.has_previous_state)
        self.resumes_chunks = self._check_resume(hidden, arguments)
        y, rest = _split(out)
        name = type(self.module).__name__
        if not isinstance(y, torch.Tensor) or y.dim() < 3 or tuple(y.shape[:2]) != tuple(hidden.shape[:2]):
            shape = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            self.unsupported = (
                f"its state layer {name} returns {shape} for {tuple(hidden.shape)} hidden states, not one "
                "row per token that genq could split by sequence"
            )
        elif any(isinstance(r, torch.Tensor) and tuple(r.shape[:2]) != tuple(hidden.shape[:2]) for r in rest):
            self.unsupported = f"its state layer {name} returns a tensor that is not one row per token"
        return out

    def _check_resume(self, hidden: torch.Tensor, arguments: dict) -> bool:
        """Whether the layer continues a chunk from a state it left, in one call, as it would have
        run the whole sequence: then later chunks of a prompt run whole, else one token per call."""
        x = torch.cat([hidden, hidden.flip(1), hidden], dim=1)  # a sequence of 9 tokens, made to vary
        noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        x = x + noise.to(x.device, x.dtype) * x.abs().mean().clamp(min=1e-3)
        others = {k: v for k, v in arguments.items() if _map(v, hidden.shape[1], lambda t: None) is v}
        try:
            _, cache = self._cache(None)
            whole = _tensors(self.original(x, **{self.cache_arg: cache}, **others))
            first, cache = self._cache(None)
            head = _tensors(self.original(x[:, :4], **{self.cache_arg: cache}, **others))
            states = {("conv", i): t for i, t in first.conv_states.items() if t is not None}
            states |= {("recurrent", i): t for i, t in first.recurrent_states.items() if t is not None}
            _, cache = self._cache(states)
            tail = _tensors(self.original(x[:, 4:], **{self.cache_arg: cache}, **others))
        except Exception:  # noqa: BLE001 - a layer that cannot: one token per call
            return False
        errors = []
        for w, h, t in zip(whole, head, tail):  # every per-token output: ZAYA's query, key and value
            got = torch.cat([h, t], dim=1)
            errors.append(((got - w).abs().max() / w.abs().max().clamp(min=1.0)).item())
        return max(errors) <= RESUME_TOLERANCE.get(hidden.dtype, 2e-2)

    def _run(self, hidden: torch.Tensor, arguments: dict, step: StateStep):
        total = hidden.shape[1]
        assert hidden.shape[0] == 1 and total == step.num_rows, "a packed step is one row of every token"
        outs: list[torch.Tensor] | None = None
        tupled = False
        chunks = [(start, n, slot, False) for start, n, slot in step.fresh]
        if self.resumes_chunks:
            chunks += [(start, n, slot, True) for start, n, slot in step.chunks]

        def place(result, where) -> None:
            nonlocal outs, tupled
            ys = list(result) if isinstance(result, tuple) else [result]
            tupled = isinstance(result, tuple)
            if outs is None:
                outs = [y.new_empty(1, total, *y.shape[2:]) if isinstance(y, torch.Tensor) else y for y in ys]
            for o, y in zip(outs, ys):
                if isinstance(o, torch.Tensor) and isinstance(y, torch.Tensor):
                    where(o, y)

        for start, n, slot, resumed in chunks:
            layer, cache = self._cache(self._gather(step.cache, slot) if resumed else None)
            result = self.original(
                hidden[:, start : start + n], **{self.cache_arg: cache}, **_rows(arguments, total, start, n)
            )
            place(result, lambda o, y, s=start, k=n: o.__setitem__((slice(None), slice(s, s + k)), y))
            self._store(step.cache, layer, slot)
        waves = step.waves if self.resumes_chunks else step.token_waves
        for rows, slots in waves:
            layer, cache = self._cache(self._gather(step.cache, slots))
            result = self.original(
                hidden[0, rows].unsqueeze(1), **{self.cache_arg: cache}, **_wave(arguments, total, rows)
            )
            place(result, lambda o, y, r=rows: o[0].__setitem__(r, y[:, 0]))
            self._store(step.cache, layer, slots)
        assert outs is not None, "a step with rows runs at least one call"
        return tuple(outs) if tupled else outs[0]

    def _gather(self, cache: StateCache, slots: torch.Tensor) -> dict[tuple[str, int], torch.Tensor]:
        found = {}
        for spec in cache.geometry.specs:
            if (
                spec.layer == self.layer_idx
                and (t := cache.gather(spec.layer, spec.kind, spec.index, slots)) is not None
            ):
                found[(spec.kind, spec.index)] = t
        return found

    def _store(self, cache: StateCache, layer, slots: torch.Tensor) -> None:
        for spec in cache.geometry.specs:
            if spec.layer != self.layer_idx:
                continue
            tensors = layer.conv_states if spec.kind == "conv" else layer.recurrent_states
            value = tensors.get(spec.index)
            if value is None:
                raise RuntimeError(
                    f"layer {self.layer_idx} left no {spec.kind} state {spec.index} in its cache"
                )
            cache.scatter(spec.layer, spec.kind, spec.index, slots, value)

    def _cache(self, states: dict[tuple[str, int], torch.Tensor] | None):
        """(transformers' cache layer, a Cache holding it at this layer's index), holding `states`."""
        from transformers.cache_utils import Cache, DummyLayer, LinearAttentionLayer

        layer: Any = LinearAttentionLayer(number_of_states=self.num_states)
        if states:
            for (kind, i), t in states.items():
                layer.device, layer.dtype = t.device, t.dtype
                if kind == "conv":
                    layer.conv_states[i] = t
                    layer.conv_kernel_size[i] = t.shape[-1]
                    layer.is_conv_states_initialized[i] = True
                else:
                    layer.recurrent_states[i] = t
                    layer.is_recurrent_states_initialized[i] = True
            layer.has_previous_state.update(self.previous_flags)
        layers: list = [DummyLayer() for _ in range(self.layer_idx)]
        return layer, Cache(layers=[*layers, layer])


def _tensors(result) -> list[torch.Tensor]:
    """The tensors of a layer's output, in order."""
    items = result if isinstance(result, tuple) else (result,)
    return [t for t in items if isinstance(t, torch.Tensor)]


def _split(result) -> tuple[torch.Tensor, tuple]:
    if isinstance(result, tuple):
        return result[0], tuple(result[1:])
    return result, ()


def _rows(arguments: dict, total: int, start: int, n: int) -> dict:
    """The call's other arguments for rows [start, start + n) (per-token tensors sliced)."""
    return {k: _map(v, total, lambda t: t[:, start : start + n]) for k, v in arguments.items()}


def _wave(arguments: dict, total: int, rows: torch.Tensor) -> dict:
    """The call's other arguments for one token of each of `rows`' sequences ([n, 1, ...])."""
    return {k: _map(v, total, lambda t: t[0, rows].unsqueeze(1)) for k, v in arguments.items()}


def _map(value, total: int, take):
    if (
        isinstance(value, torch.Tensor)
        and value.dim() >= 2
        and value.shape[0] == 1
        and value.shape[1] == total
    ):
        return take(value)
    if isinstance(value, tuple):
        return tuple(_map(v, total, take) for v in value)
    return value


def is_state_module(module: torch.nn.Module) -> bool:
    """A layer that keeps its state in transformers' cache: it calls the cache's state methods."""
    if not isinstance(getattr(module, "layer_idx", None), int):
        return False
    forward = type(module).forward
    try:
        source = inspect.getsource(forward)
        names = inspect.signature(forward).parameters
    except (OSError, TypeError, ValueError):
        return False
    return any(call in source for call in CACHE_CALLS) and any(a in names for a in CACHE_ARGS)


def install(model) -> list[StateLayer]:
    """Wrap every state layer of `model` (once); returns the wrappers (none: an attention-only model)."""
    existing = getattr(model, "_genq_state_layers", None)
    if existing is not None:
        return existing
    from transformers.cache_utils import get_layer_types_and_kwargs

    per_layer: dict[int, int] = {}
    try:
        _, kwargs = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
        per_layer = {i: kw.get("number_of_states", 1) for i, kw in enumerate(kwargs)}
    except Exception:  # noqa: BLE001 - a config transformers reads no layer kinds from: one state each
        pass
    wrapped = [StateLayer(m, per_layer.get(m.layer_idx, 1)) for m in model.modules() if is_state_module(m)]
    model._genq_state_layers = wrapped
    return wrapped


def installed(model) -> list[StateLayer]:
    return getattr(model, "_genq_state_layers", None) or []


def geometry(model) -> StateGeometry | None:
    """What the state layers keep per sequence, as the shape forward recorded it (None: no state layers)."""
    layers = installed(model)
    if not layers:
        return None
    specs = [spec for layer in layers for spec in layer.recorded]
    return StateGeometry(specs, {layer.layer_idx: layer.num_states for layer in layers})
