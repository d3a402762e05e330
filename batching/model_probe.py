"""Proof at load that genq's paged attention is what the model runs, and that nothing is lost.

transformers' model code computes q/k/v and calls the registered attention function; genq trusts it
to pass everything that shapes attention as arguments. A model can break that trust silently: run
its own attention (bloom, codegen), express a sliding window or chunks only through the mask it
builds (phimoe, llama4), compute a mask of its own (doge), call attention twice per
layer (diffllama), attend bidirectionally (bert), or position its tokens from a cache genq does not
pass (bart). So before an engine serves, the model runs under a *probe* implementation that
records every attention call, and whose mask hook returns the model's mask as a function of
positions (`MaskProbe`) instead of a tensor. Model code that computes with that mask itself (reads it
as a tensor, hands it to torch: doge builds its dynamic mask from it) makes it raise `MaskUsed`, the
refusal for a model that needs a mask genq does not build; any other exception in a forward is
unexpected (a genq bug or the model's), logged with its traceback and never read as a refusal:

1. `kv_geometry`: one single-sequence forward whose attention only records gives each layer's KV
   heads and K/V head sizes, so that the cache stores each layer at its own size (MLA's K and V of
   different sizes, gemma4's per-layer sizes), and each layer's mask, read at positions up to max_model_len: it must
   be causal, within the window the call passes; a window or chunks that only the mask expresses
   are returned (`MaskPattern`) and genq's attention applies them.
2. `verify`: requests of different lengths run through the engine's real step (scheduler, packed
   batch, paged KV). Every forward must call attention exactly once per attention layer, each time
   with all the step's tokens, transformers' mask and no argument genq would ignore. Last, the
   logits genq computed must match the model's own eager attention run on each sequence alone.

Anything else raises `Refusal` (a ValueError) naming the model type and what genq lacks. The probe's
recorder is a module global set only while the probe runs (steps in service pass their metadata
through the forward's kwargs, as always, or the runner's step context for the attention classes of
falcon, gptj and gpt_neo, attention_classes.py, which route their core attention through the same
interface).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NoReturn

import torch

from batching import state_layers
from batching.attention import ATTENTION_NAME, paged_attention, step_context
from batching.attention_classes import set_attention
from batching.kv_cache import LayerGeometry

log = logging.getLogger(__name__)

PROBE_NAME = "genq_probe"
# logits genq computes vs the model's own eager attention: max |diff| / max(1, max |reference|)
# (float32 routers and rotary tables round differently in a packed batch: ~1e-6 even in float64;
# what the check is for, a model using something genq does not pass, errs by 0.1 to 1)
LOGIT_TOLERANCE = {torch.float64: 1e-4, torch.float32: 1e-2}
HALF_TOLERANCE = 0.25  # bfloat16 / float16: rounding differs between paths; catches gross errors only
# keyword arguments attention calls may carry that change nothing genq computes
HARMLESS_KWARGS = {
    "dropout",
    "scaling",
    "position_ids",
    "output_attentions",
    "use_cache",
    "cache_position",
    "past_key_values",
    "past_key_value",
    "head_mask",
    "layer_head_mask",
    "is_causal",
    "sliding_window",
    "softcap",
    "s_aux",
    "genq_attn",
    "return_dict",
    "output_hidden_states",
    "output_router_logits",
    "logits_to_keep",
}


@dataclass(slots=True)
class AttentionCall:
    module: object
    layer_idx: int | None
    num_tokens: int | None  # the step's packed tokens (None in the shape forward)
    q_shape: tuple
    k_shape: tuple
    v_shape: tuple
    sliding_window: int | None
    mask: object
    kwargs: dict


class MaskUsed(AttributeError):
    """A model's own code computed with the mask the probe handed it (read a tensor attribute of it, passed
    it to a torch function or an operator). In service genq builds no mask (the model gets None), so such a
    model would attend without what its code adds to the mask (Doge's dynamic mask): a refusal. An
    AttributeError, so that `hasattr`/`getattr(mask, name, default)` in a model's code behave as before."""

    def __init__(self, use: str):
        super().__init__(f"the model's code {use} (genq builds no attention mask)")
        self.use = use


@dataclass(slots=True, eq=False)
class MaskProbe:
    """What the probe's mask hook returns instead of a dense mask: the model's mask as a function.

    Whatever treats it as a tensor raises MaskUsed: attributes it lacks, torch functions and operators."""

    mask_function: Callable[..., torch.Tensor]

    def __getitem__(self, item):  # modules that slice the mask to the key length
        return self

    def allows(self, q: int, kv: torch.Tensor) -> torch.Tensor:
        """[len(kv)] bool: which key positions `kv` the query at position `q` may see."""
        zero = torch.zeros((), dtype=torch.long, device=kv.device)
        return self.mask_function(zero, zero, zero + q, kv).to(torch.bool).expand(kv.shape)

    def __getattr__(self, name: str) -> NoReturn:  # only names the class lacks: `mask.dtype`, `mask.shape`
        raise MaskUsed(f"reads mask.{name}")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None) -> NoReturn:
        raise MaskUsed(f"passes the mask to {getattr(func, '__name__', func)}()")


def _operator(name: str) -> Callable[..., NoReturn]:
    def use(self, *other) -> NoReturn:
        raise MaskUsed(f"applies {name} to the mask")

    return use


for _name in (
    *(f"__{op}__" for op in ("eq", "ne", "lt", "le", "gt", "ge", "neg", "pos", "invert", "abs", "bool")),
    *(f"__{r}{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul",
                                "and", "or", "xor") for r in ("", "r")),
):  # fmt: skip
    setattr(MaskProbe, _name, _operator(_name))


@dataclass(slots=True)
class KVGeometry:
    layers: list[LayerGeometry | None]  # by layer index: what it caches (None: no attention call)
    query_width: float | None  # query heads x head size, averaged over the layers (for step costs)
    mask_patterns: dict[int, MaskPattern]  # by layer: windows and chunks only the mask expresses


@dataclass(frozen=True, slots=True)
class MaskPattern:
    """What a layer's mask expresses beyond causal that its attention call does not pass."""

    window: int | None = None  # a sliding window (phimoe: in the mask only)
    chunk: int | None = None  # chunked attention: a query sees its own chunk of `chunk` positions (llama4)


class _ShapeRun:
    """genq_attn of the shape forward: attention records and returns zeros, no cache exists yet."""


@dataclass(slots=True)
class _Recorder:
    calls: list[AttentionCall] = field(default_factory=list)


_recorder: _Recorder | None = None


def _probe_attention(module, query, key, value, attention_mask, *args, genq_attn=None, **kwargs):
    if genq_attn is None:
        raise refusal(
            getattr(getattr(module, "config", None), "model_type", type(module).__name__),
            f"{type(module).__name__} does not pass the forward's keyword arguments on to its attention "
            "(genq's step metadata travels that way)",
        )
    if _recorder is not None:
        num_tokens = None if isinstance(genq_attn, _ShapeRun) else genq_attn.slot_mapping.numel()
        _recorder.calls.append(
            AttentionCall(
                module,
                getattr(module, "layer_idx", None),
                num_tokens,
                tuple(query.shape),
                tuple(key.shape),
                tuple(value.shape),
                kwargs.get("sliding_window"),
                attention_mask,
                {k: v for k, v in kwargs.items() if v is not None},
            )
        )
    if isinstance(genq_attn, _ShapeRun):
        out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1])
        return out, None
    return paged_attention(module, query, key, value, None, *args, genq_attn=genq_attn, **kwargs)  # type: ignore[misc]


def _probe_mask(*args, mask_function=None, **kwargs):
    return MaskProbe(mask_function)


def register() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(PROBE_NAME, _probe_attention)
    AttentionMaskInterface.register(PROBE_NAME, _probe_mask)


@contextlib.contextmanager
def probing(model):
    """Run `model` under the probe implementation, recording attention calls; genq's again after."""
    global _recorder
    register()
    try:
        set_attention(model, PROBE_NAME)
    except Exception as exc:  # noqa: BLE001 - custom code that takes no registered implementation
        raise refusal(
            model.config.model_type, f"it does not take a registered attention implementation ({_brief(exc)})"
        ) from exc
    _recorder = _Recorder()
    try:
        yield _recorder
    finally:
        _recorder = None
        set_attention(model, ATTENTION_NAME)


class Refusal(ValueError):
    """The model cannot run exactly on genq's paged attention; the message says which and why.

    `unexpected`: the reason is not one the probe knows (a documented limit of genq) but an exception
    raised inside the model's forward on genq's inputs. That may be the model's, or a genq bug: the
    traceback is logged, and the model-support walk (tools/model_support.py) reports it as "crashed", never as a clean refusal."""

    def __init__(self, message: str, unexpected: bool = False):
        super().__init__(message)
        self.unexpected = unexpected


def refusal(model_type: str, reason: str, unexpected: bool = False) -> Refusal:
    return Refusal(f"model: genq cannot run {model_type}: {reason}", unexpected)


def kv_geometry(model, device: torch.device, max_len: int) -> KVGeometry:
    """Each layer's KV heads, head sizes and mask pattern, from one single-sequence forward that
    records the attention calls."""
    model_type = model.config.model_type
    num_tokens = 3
    shape_run = _ShapeRun()
    with probing(model) as rec, torch.inference_mode(), step_context(shape_run):
        try:
            model(
                input_ids=torch.full((1, num_tokens), 3, device=device),
                position_ids=torch.arange(num_tokens, device=device)[None],
                use_cache=False,
                genq_attn=shape_run,
            )
        except Refusal:
            raise
        except Exception as exc:  # noqa: BLE001 - the model's own code failed on genq's inputs
            raise _failure(model_type, exc) from exc
    stateful = bool(state_layers.installed(model))
    for layer in state_layers.installed(model):
        if layer.unsupported:
            raise refusal(model_type, layer.unsupported)
    _check_calls(model_type, rec.calls, stateful=stateful, model=model)
    if not rec.calls:  # state layers only (Mamba): no KV at all
        return KVGeometry(layers=[], query_width=None, mask_patterns={})
    layers = [c.layer_idx for c in rec.calls]
    for c in rec.calls:
        if c.q_shape[1] % c.k_shape[1]:
            raise refusal(model_type, f"{c.q_shape[1]} query heads do not group over {c.k_shape[1]} KV heads")
        if c.k_shape[1] != c.v_shape[1]:
            raise refusal(model_type, "keys and values have different numbers of heads")
        if c.q_shape[-1] != c.k_shape[-1]:
            raise refusal(model_type, "queries and keys have different head sizes")
    by_layer: list[LayerGeometry | None] = [None] * (max(layers) + 1)
    for c in rec.calls:
        by_layer[c.layer_idx] = LayerGeometry(c.k_shape[1], c.k_shape[-1], c.v_shape[-1])
    return KVGeometry(
        layers=by_layer,
        query_width=sum(c.q_shape[1] * c.q_shape[-1] for c in rec.calls) / len(rec.calls),
        mask_patterns=mask_patterns(model_type, rec.calls, max_len, model.config, device),
    )


def _check_calls(
    model_type: str,
    calls: list[AttentionCall],
    num_tokens: int | None = None,
    stateful: bool = False,
    model=None,
) -> None:
    """One forward's calls: one per attention layer, with every token and the mask transformers built
    (none at all only in a model of state layers alone, `stateful`; `model`, where given, to say which
    decoder layers hold an attention module with no index of its own)."""
    if not calls and stateful:
        return
    if not calls:
        raise refusal(
            model_type,
            "its attention does not go through transformers' AttentionInterface "
            "(the model computes attention itself), so genq's paged attention cannot run it",
        )
    seen: dict[int, AttentionCall] = {}
    modules = set()
    for c in calls:
        if c.layer_idx is None or c.layer_idx < 0:
            raise refusal(model_type, _unindexed(c, model))
        if id(c.module) in modules:
            raise refusal(
                model_type,
                f"layer {c.layer_idx} calls attention more than once per forward (its KV would be "
                "written twice)",
            )
        if c.layer_idx in seen:
            raise refusal(model_type, f"two attention modules share layer index {c.layer_idx}")
        modules.add(id(c.module))
        seen[c.layer_idx] = c
        if c.kwargs.get("is_causal") is False:
            raise refusal(model_type, f"layer {c.layer_idx} attends bidirectionally (is_causal=False)")
        unknown = sorted(set(c.kwargs) - HARMLESS_KWARGS)
        if unknown:
            raise refusal(
                model_type, f"layer {c.layer_idx} passes attention arguments genq ignores: {unknown}"
            )
        if c.mask is not None and not isinstance(c.mask, MaskProbe):
            raise refusal(
                model_type,
                f"layer {c.layer_idx} builds its own attention mask ({type(c.mask).__name__}) "
                "instead of transformers' mask functions",
            )
        tokens = num_tokens if num_tokens is not None else c.num_tokens
        if tokens is not None and (c.q_shape[2] != tokens or c.k_shape[2] != tokens):
            raise refusal(
                model_type,
                f"layer {c.layer_idx} attends {c.q_shape[2]} queries over {c.k_shape[2]} new keys where "
                f"the step packed {tokens} tokens",
            )


def _unindexed(call: AttentionCall, model) -> str:
    """Why an attention module with no layer index of its own (None, or negative) has no place in the cache,
    and what transformers would have to change: genq files a layer's KV under its module's `layer_idx`."""
    name = type(call.module).__name__
    has = "no layer_idx" if call.layer_idx is None else f"layer index {call.layer_idx}"
    layers = getattr(model.get_decoder(), "layers", None) if hasattr(model, "get_decoder") else None
    holders = [i for i, layer in enumerate(layers or ()) if any(m is call.module for m in layer.modules())]
    if len(holders) > 1:
        return (
            f"its attention module {name} has {has}, and decoder layers {holders} run that one module, so their "
            "KV has no place of its own per layer in the cache; transformers would have to give each layer an "
            "attention module of its own with that layer's index (tied weights can stay shared)"
        )
    where = f" of decoder layer {holders[0]}" if holders else ""
    return (
        f"its attention module {name}{where} has {has}: the model's decoder loop passes the layer's index to the "
        "block's forward (where its own cache files the KV under it), and the index never reaches the attention "
        f"function; transformers would have to set the module's layer_idx to its layer's index, as its other "
        "models do"
    )


def mask_patterns(
    model_type: str, calls: list[AttentionCall], max_len: int, config, device: torch.device
) -> dict[int, MaskPattern]:
    """Single-sequence forward: what each layer's mask allows, as a function of positions up to
    max_len, must be causal, within the window its call passes or one the mask alone expresses
    (returned, so that genq applies it), or chunked. Layers that need nothing extra are left out."""
    patterns: dict[int, MaskPattern] = {}
    cache_windows = _cache_windows(config)
    for c in calls:
        if c.layer_idx is None:
            raise refusal(model_type, f"{type(c.module).__name__} does not say which layer it is (layer_idx)")
        if c.mask is None:
            raise refusal(model_type, f"layer {c.layer_idx} gets no attention mask from transformers")
        positions = _probe_positions(max_len, config, c.sliding_window)
        window, chunk = _read_mask(model_type, c, positions, max_len, device)
        sw = c.sliding_window
        if sw is not None and sw >= max_len:
            sw = None  # a window no context reaches
        if chunk is not None and sw is not None:
            raise refusal(model_type, f"layer {c.layer_idx} is chunked by its mask and windowed by its call")
        if window is None and chunk is None and sw is not None:
            raise refusal(
                model_type,
                f"layer {c.layer_idx} passes sliding_window={sw} but its mask attends the whole context",
            )
        if window is not None and sw is not None and window != sw:
            raise refusal(
                model_type,
                f"layer {c.layer_idx}'s mask has a window of {window} but its call passes sliding_window={sw}",
            )
        if (window is not None and sw is None) or chunk is not None:
            patterns[c.layer_idx] = MaskPattern(window if sw is None else None, chunk)
        kept = cache_windows.get(c.layer_idx)
        if kept is not None and kept < max_len and kept not in (sw or window, chunk):
            raise refusal(
                model_type,
                f"its cache keeps only the last {kept} tokens of layer {c.layer_idx}, a window that neither "
                "its attention call nor its mask expresses (its prompts and its decodes attend differently)",
            )
    return patterns


def _cache_windows(config) -> dict[int, int]:
    """The windows of the layers whose cache generate() keeps short (DynamicCache from the config)."""
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=config.get_text_config(decoder=True))
    except Exception:  # noqa: BLE001 - a config DynamicCache cannot read: no cache-only windows to find
        return {}
    layers = getattr(cache, "layers", [])
    return {i: w for i, layer in enumerate(layers) if (w := getattr(layer, "sliding_window", None))}


def _read_mask(model_type: str, call: AttentionCall, positions: list[int], max_len: int, device):
    """(window, chunk) of a causal mask whose visible keys are one run ending at the query."""
    first_seen = {}
    for q in positions:
        kv = torch.arange(min(q + 2, max_len), device=device)
        try:
            assert isinstance(call.mask, MaskProbe)  # the probe's mask hook made it
            allowed = call.mask.allows(q, kv)
        except Exception as exc:  # noqa: BLE001 - a mask function genq cannot evaluate
            raise refusal(model_type, f"layer {call.layer_idx}'s mask cannot be read: {_brief(exc)}") from exc
        seen = kv[allowed]
        lo = int(seen.min()) if seen.numel() else q
        if not (seen.numel() and int(seen.max()) == q and seen.numel() == q - lo + 1):
            span = f"positions {seen.tolist()[:8]}{'...' if seen.numel() > 8 else ''}"
            raise refusal(
                model_type,
                f"layer {call.layer_idx}'s mask lets position {q} see {span}: not a causal pattern genq "
                "attends (bidirectional, prefix or custom)",
            )
        first_seen[q] = lo
    starts = {q: lo for q, lo in first_seen.items() if lo > 0}
    if not starts:
        return None, None
    windows = {q - lo + 1 for q, lo in starts.items()}
    if len(windows) == 1:
        window = windows.pop()
        if all(lo > 0 or q < window for q, lo in first_seen.items()):
            return window, None
    chunk = min(starts)
    if all(lo == q // chunk * chunk for q, lo in first_seen.items()):
        return None, chunk
    raise refusal(model_type, f"layer {call.layer_idx}'s mask is neither a window nor chunks genq attends")


def _probe_positions(max_len: int, config, sliding_window: int | None) -> list[int]:
    """Query positions that reveal a window, chunk or prefix: small ones, powers of two, and around
    every size the config names."""
    sizes = {sliding_window or 0}
    for name, value in vars(config).items():
        if isinstance(value, int) and not isinstance(value, bool) and 1 < value < max_len:
            if any(word in name for word in ("window", "chunk", "local", "prefix", "block")):
                sizes.add(value)
    points = set(range(min(max_len, 40)))
    p = 32
    while p < max_len:
        points.update((p - 1, p, p + 1))
        p *= 2
    for s in sizes:
        points.update((s - 2, s - 1, s, s + 1, 2 * s - 1, 2 * s, 2 * s + 1))
    points.add(max_len - 1)
    return sorted(q for q in points if 0 <= q < max_len)


def _failure(model_type: str, exc: BaseException) -> Refusal:
    """An exception raised in the model's forward under the probe: the device's lack of memory is raised
    as it is; the model computing with the mask (MaskUsed, wherever in the exception's chain) is the
    documented refusal; anything else is unexpected (a genq bug or the model's), logged with its traceback."""
    if _out_of_memory(exc) or isinstance(exc, torch.distributed.DistBackendError):
        raise exc  # the device was short of memory, or a rank of a tensor-parallel engine failed: say that
    used = _mask_used(exc)
    if used is not None:
        return refusal(
            model_type,
            f"it computes with the attention mask in its own code, where genq builds none ({_where(used)}"
            f"{used.use})",
        )
    log.error("%s: its forward raised on genq's packed batch", model_type, exc_info=exc)
    return refusal(model_type, f"its forward fails on genq's packed batch: {_brief(exc)}", unexpected=True)


def _mask_used(exc: BaseException) -> MaskUsed | None:
    """The MaskUsed that `exc` is or was raised from (a model may wrap it in an error of its own)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        if isinstance(e, MaskUsed):
            return e
        seen.add(id(e))
        todo += [e.__cause__, e.__context__]
    return None


def _where(exc: BaseException) -> str:
    """`file:line function: ` of the innermost frame of `exc`'s traceback outside this module and torch
    (the model's line that touched the mask), or nothing."""
    torch_dir = os.path.dirname(torch.__file__)
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if f.filename != __file__ and not f.filename.startswith(torch_dir)
    ]
    return (
        f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno} {frames[-1].name}: " if frames else ""
    )


def _out_of_memory(exc: BaseException) -> bool:
    """torch's allocator (OutOfMemoryError) or a kernel launcher (Triton's `RuntimeError: Triton Error
    [CUDA]: out of memory`) ran out of device memory: no refusal of the model, the error itself."""
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _brief(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}"


class _RecordingSampler:
    """Wraps the engine's sampler during the probe: keeps each row's logits with its sequence."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.rows: dict[str, list[tuple[int, torch.Tensor]]] = {}  # req_id -> [(num_tokens, logits [V])]

    def sample(self, logits, seqs):
        for row, seq in zip(logits, seqs):
            self.rows.setdefault(seq.req_id, []).append((seq.num_tokens, row.detach().clone()))
        return self.sampler.sample(logits, seqs)

    def forget(self, seq) -> None:
        self.sampler.forget(seq)


def verify(engine) -> None:
    """Run probe requests through the engine's real step and check every forward (module docstring)."""
    from batching.sampling_params import SamplingParams

    model, model_type = engine.model, engine.model.config.model_type
    slots = engine.block_manager.num_device_blocks * engine.config.block_size
    longest = min(engine.max_model_len, slots + 1)  # prompt + max_tokens of one request

    def request(length: int, max_tokens: int) -> tuple[list[int], SamplingParams]:
        max_tokens = max(1, min(max_tokens, longest - 1))
        length = max(1, min(length, longest - max_tokens))
        vocab = max(engine.vocab_size - 3, 1)
        prompt = [3 + (7 * i + length) % vocab for i in range(length)]
        return prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

    sampler = engine.sampler
    engine.sampler = recording = _RecordingSampler(sampler)
    prompts: dict[str, list[int]] = {}
    try:
        with probing(model) as rec:
            # a single sequence first: its masks are functions of positions alone (no packing)
            prompt, params = request(12, 2)
            prompts["__probe_single__"] = prompt
            engine.add_request("__probe_single__", prompt, params)
            while engine.has_unfinished_requests():
                _probe_step(engine, model_type, rec)
                rec.calls.clear()
            # then sequences of different lengths packed together, prefills and decodes mixed
            for i, (length, max_tokens) in enumerate(((5, 4), (1, 3), (9, 3), (3, 2))):
                prompt, params = request(length, max_tokens)
                prompts[f"__probe_{i}__"] = prompt
                engine.add_request(f"__probe_{i}__", prompt, params)
            while engine.has_unfinished_requests():
                _probe_step(engine, model_type, rec)
                rec.calls.clear()
    except Refusal:
        raise
    except Exception as exc:  # noqa: BLE001 - the model's code failed on the probe's inputs
        raise _failure(model_type, exc) from exc
    finally:
        engine.sampler = sampler
    _check_logits(engine, model_type, prompts, recording.rows)


def _probe_step(engine, model_type: str, rec: _Recorder) -> None:
    engine.step()
    if rec.calls or engine.stats()["last_step_num_tokens"]:  # a forward ran (no calls: refused)
        _check_calls(model_type, rec.calls, stateful=bool(state_layers.installed(engine.model)))


def _check_logits(engine, model_type: str, prompts: dict[str, list[int]], rows) -> None:
    """genq's logits against the model's own eager attention over each whole sequence alone (a
    model with state layers: as generate() runs it, the prompt in one forward and then one token per
    forward with transformers' own cache, whose single-token path some state layers compute
    differently from their whole-sequence one).

    In float32/64 every row must agree. In 16 bits a mixture-of-experts router may pick another
    expert for a row when the two paths round differently (a tiny PhiMoE in bfloat16 did), so
    there it takes most rows off to refuse: what this check is for, something genq does not pass
    (BART-style decoders that position tokens themselves), is off in nearly every row."""
    model = engine.model
    tolerance = LOGIT_TOLERANCE.get(engine.dtype, HALF_TOLERANCE)
    most = engine.dtype not in LOGIT_TOLERANCE
    if engine.kv_cache.quantized:  # an 8-bit KV cache rounds what attention reads: as in 16 bits,
        tolerance, most = HALF_TOLERANCE, True  # gross errors only
    try:
        set_attention(model, "eager")
    except (ValueError, AttributeError, NotImplementedError) as exc:
        log.warning("%s: no eager attention to check genq's logits against (%s)", model_type, exc)
        return
    errors = []  # (relative error, token index, prompt length)
    try:
        with torch.inference_mode():
            for req_id, recorded in rows.items():
                last = max(n for n, _ in recorded)
                # the prompt, then the greedy tokens genq chose from the recorded rows
                chosen = [int(row.argmax()) for _, row in sorted(recorded, key=lambda item: item[0])]
                ids = torch.tensor([(prompts[req_id] + chosen)[:last]], device=engine.device)
                try:
                    if state_layers.installed(model):  # as generate() runs them: prompt, then token by token
                        reference = _incremental_logits(model, ids, len(prompts[req_id]))
                    else:
                        if engine.ranks is not None:  # tensor parallel: the other ranks run it too
                            engine.ranks.send_reference(ids[0].tolist())
                        reference = model(input_ids=ids, use_cache=False).logits[0]  # [n, V]
                except torch.distributed.DistBackendError:
                    raise  # a rank of a tensor-parallel engine failed: not the model's
                except Exception as exc:  # noqa: BLE001 - eager fails where genq ran: no reference
                    log.warning("%s: its eager attention fails (%s); logits not compared", model_type, exc)
                    return
                for num_tokens, got in recorded:
                    ref = reference[num_tokens - 1].float()
                    err = ((got.float() - ref).abs().max() / ref.abs().max().clamp(min=1.0)).item()
                    errors.append((err, num_tokens, len(prompts[req_id])))
    finally:
        set_attention(model, ATTENTION_NAME)
    bad = [e for e in errors if not e[0] <= tolerance]
    if bad and (not most or 2 * len(bad) > len(errors)):
        err, num_tokens, prompt_len = max(bad)
        raise refusal(
            model_type,
            f"its logits on genq's paged attention differ from its own eager attention in {len(bad)} of "
            f"{len(errors)} rows (relative error up to {err:.2g}, at token {num_tokens} of a {prompt_len}-token "
            "prompt): the model's output depends on something genq does not pass",
        )


def _incremental_logits(model, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """[n, V] logits of `ids` [1, n] as generate() computes them: the first `prompt_len` tokens in one
    forward with a fresh DynamicCache, then one token per forward (rows before the prompt's last: NaN)."""
    from transformers import DynamicCache

    names = inspect.signature(model.forward).parameters
    arg = "past_key_values" if "past_key_values" in names else "cache_params"  # (Mamba's)
    cache = {arg: DynamicCache(config=model.config)}
    positions = torch.arange(ids.shape[1], device=ids.device)[None]  # (a cache of state layers has no length)
    first = model(
        input_ids=ids[:, :prompt_len], position_ids=positions[:, :prompt_len], use_cache=True, **cache
    )
    rows = [torch.full_like(first.logits[0, :-1], float("nan")), first.logits[0, -1:]]
    for i in range(prompt_len, ids.shape[1]):
        step = model(
            input_ids=ids[:, i : i + 1], position_ids=positions[:, i : i + 1], use_cache=True, **cache
        )
        rows.append(step.logits[0])
    return torch.cat(rows)
