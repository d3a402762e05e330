"""Loading a decoder model by HF id or local path, or building the built-in tiny-llama."""

from __future__ import annotations

import copy
import logging
import os

import torch

from batching import attention_classes, state_layers
from batching.attention import ATTENTION_NAME, paged_attention
from batching.config import EngineConfig
from batching.model_probe import refusal
from batching.quantization import check_quantization, check_weights, quantization_of
from batching.tokenizer import BOS_ID, BUILTIN_MODEL, EOS_ID, load_tokenizer

log = logging.getLogger(__name__)

TORCH_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}
# layers that keep a state instead of (or beside) KV, or none: run from genq's state cache when their
# code keeps the state through transformers' cache API (state_layers.py), refused otherwise
STATE_LAYER_TYPES = {"linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba", "mlp", "moe"}


# state layers that keep their state where genq cannot give each sequence its own: where, and what transformers
# would have to change for genq to run them (a state kept in the cache passed to the forward, by layer index, through
# get_conv_state/update_conv_state and get_recurrent_state/update_recurrent_state, as its Mamba and gated delta net
# layers keep theirs, is what state_layers.py gives each sequence)
STATE_OUTSIDE_CACHE = {
    "RecurrentGemmaRecurrentBlock": "RecurrentGemmaRecurrentBlock keeps its convolution window and its RG-LRU state "
    "in attributes of the module (conv1d_state, rg_lru.recurrent_states): one state for the whole batch, its "
    "window restarted by every forward of more than one token; transformers would have to keep both in the cache "
    "passed to the forward, by layer index (update_conv_state/update_recurrent_state), and continue a forward "
    "from the cached window whatever its length",
    "MiniMaxLightningAttention": "MiniMaxLightningAttention keeps its state through get_linear_cache/"
    "set_linear_cache, methods of MiniMax's own cache class (MiniMaxCache, which MiniMaxModel requires of any "
    "cache passed to it); transformers would have to keep it through the cache API's "
    "get_recurrent_state/update_recurrent_state by layer index, as Qwen3-Next's gated delta net does",
}


def tiny_llama_config():
    """A small Llama (4 layers, hidden 128, GQA 4:2) over the byte-level tokenizer's 259 ids."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=259,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=0,
        tie_word_embeddings=False,
        # wider than the usual 0.02 so logits have clear winners and greedy text is stable across batches
        initializer_range=0.25,
    )


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device: {name!r} was asked for but CUDA is not available")
    return torch.device(name)


def resolve_dtype(name: str, model_config, device: torch.device) -> torch.dtype:
    if name != "auto":
        return TORCH_DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    checkpoint = getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", None)
    if isinstance(checkpoint, str):
        checkpoint = TORCH_DTYPES.get(checkpoint)
    return checkpoint if checkpoint in (torch.float16, torch.bfloat16, torch.float32) else torch.bfloat16


def load_model_config(config: EngineConfig):
    """The model's HF config (its own copy), refusing architectures the engine cannot run."""
    if config.model == BUILTIN_MODEL:
        model_config = tiny_llama_config()
    else:
        from transformers import AutoConfig

        check_model_source(config)

        try:
            model_config = AutoConfig.from_pretrained(
                config.model, revision=config.revision, trust_remote_code=config.trust_remote_code
            )
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"model: cannot load {config.model!r} (not the built-in {BUILTIN_MODEL!r}, "
                f"a local checkpoint directory or a reachable Hugging Face id): {exc}"
            ) from exc
        model_config = copy.deepcopy(model_config)
    _check_supported(model_config)
    check_quantization(model_config, resolve_device(config.device))
    return model_config


def check_model_source(config: EngineConfig) -> None:
    """Fail fast on a model that cannot be found: transformers retries an unreachable Hub for ~25 s."""
    name = config.model
    if name == BUILTIN_MODEL or os.path.isdir(name):
        return
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HFValidationError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    what = f"model: {name!r} is not the built-in {BUILTIN_MODEL!r}, not a local checkpoint directory"
    try:
        cached = try_to_load_from_cache(name, "config.json", revision=config.revision)
    except HFValidationError as exc:
        raise ValueError(f"{what}, and not a valid Hugging Face id ({exc})") from None
    if isinstance(cached, str):
        return
    if constants.is_offline_mode():
        raise ValueError(f"{what}, and not in the Hugging Face cache (offline mode is on)")
    try:
        get_hf_file_metadata(hf_hub_url(name, "config.json", revision=config.revision), timeout=10)
    except GatedRepoError:
        return  # it exists; loading reports what access it needs
    except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError) as exc:
        raise ValueError(f"{what}, and not a model on the Hugging Face Hub ({type(exc).__name__})") from exc
    except Exception as exc:  # network errors (their classes depend on the HTTP client hub uses)
        raise ValueError(
            f"{what}, not in the Hugging Face cache, and the Hub cannot be reached "
            f"({type(exc).__name__}: {exc})"
        ) from exc


def _check_supported(model_config) -> None:
    if getattr(model_config, "is_encoder_decoder", False):
        raise refusal(model_config.model_type, "it is an encoder-decoder; genq runs decoder-only models")
    if uses_alibi(model_config):
        rotary = " (rotary Falcon, alibi=False, runs)" if model_config.model_type == "falcon" else ""
        raise refusal(
            model_config.model_type,
            "it adds ALiBi position biases to the attention scores inside its own attention code, which no "
            "transformers hook (AttentionInterface or an attention-class table) lets genq replace; genq's "
            f"paged attention takes no ALiBi{rotary}",
        )
    if getattr(model_config, "languages", None) and not getattr(model_config, "default_language", None):
        raise refusal(
            model_config.model_type,
            "it routes every token through the adapter of a language given per request (lang_ids), and its "
            "config names no default_language; genq carries no language per request (set default_language "
            "in the config to run it in one language)",
        )
    layer_types = set(getattr(model_config, "layer_types", None) or ())
    unsupported = layer_types - SUPPORTED_LAYER_TYPES - STATE_LAYER_TYPES
    if unsupported:
        raise refusal(
            model_config.model_type,
            f"its layer types {sorted(unsupported)} have no paged attention in genq (only "
            f"{sorted(SUPPORTED_LAYER_TYPES)}, and state layers of types "
            f"{sorted(STATE_LAYER_TYPES - {'mlp', 'moe'})})",
        )


def uses_alibi(model_config) -> bool:
    """The ALiBi models of transformers: bloom always, falcon and mpt when their config says so."""
    if model_config.model_type == "bloom":
        return True
    attn_config = getattr(model_config, "attn_config", None)  # mpt
    return bool(getattr(model_config, "alibi", False) or getattr(attn_config, "alibi", False))


def load_model(config: EngineConfig, device: torch.device, dtype: torch.dtype, model_config, shard=None):
    """The causal LM on `device` in `dtype`, in eval mode, with genq's paged attention plugged in. `shard`
    (tensor parallel: tensor_parallel.shard_model for this rank) cuts the model before it moves to `device`."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    attention_classes.install(model_config)  # falcon, gptj, gpt_neo: genq's class in their own table
    # No AttentionMaskInterface entry on purpose: transformers then builds no dense mask at all.
    model_config._attn_implementation = ATTENTION_NAME
    if config.model == BUILTIN_MODEL:
        model = build_tiny_llama(model_config)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(
                config.model,
                config=model_config,
                dtype=dtype,
                revision=config.revision,
                trust_remote_code=config.trust_remote_code,
                attn_implementation=ATTENTION_NAME,
            )
        except OSError as exc:
            raise ValueError(f"model: cannot load weights of {config.model!r}: {exc}") from exc
        except (ImportError, RuntimeError, NotImplementedError, ValueError) as exc:
            quantization = quantization_of(model_config)
            if quantization is not None:  # its quantizer's package or kernels are missing here
                raise refusal(
                    model_config.model_type,
                    f"transformers cannot load its {quantization} quantization on {device.type}: "
                    f"{_first_line(exc)}",
                ) from exc
            if not isinstance(exc, ValueError):
                raise
            raise refusal(
                model_config.model_type, f"transformers cannot load {config.model!r} as a causal LM: {exc}"
            ) from exc
        except KeyError as exc:
            if exc.args != (ATTENTION_NAME,):
                raise
            raise refusal(
                model_config.model_type,
                "it picks its attention class from its own table, which has no genq class (genq has them "
                f"for {', '.join(sorted(attention_classes.TABLES))}: attention_classes.py)",
            ) from exc
    attention_classes.set_attention(model, ATTENTION_NAME)
    _index_per_layer_attention(model)
    _install_state_layers(model, model_config)
    if dtype == torch.float64:
        use_eager_experts(model)
    if shard is not None:
        shard(model)
    if quantization_of(model_config) is None:
        model = model.to(device=device, dtype=dtype)
    else:  # loaded in `dtype` already; quantized weights keep their own (bitsandbytes refuses a cast)
        model = model.to(device=device)
        check_weights(model, dtype, model_config.model_type)
    model = model.eval()
    model.requires_grad_(False)
    return model


def _index_per_layer_attention(model) -> None:
    """Zamba and Zamba2 build an attention block for each of their hybrid layers (the blocks' weights tied) but
    give it no layer index of its own (Zamba: None, Zamba2: -1): their decoder loop passes the layer's index to
    the block's forward, and it never reaches the attention function. genq files a layer's KV under its attention
    module's `layer_idx`: an attention module that one decoder layer alone holds gets that layer's index, the one
    generate()'s cache uses. One module held by several layers keeps what it has (the probe refuses it)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        return
    holders: dict[torch.nn.Module, set[int]] = {}
    for i, layer in enumerate(layers):
        for module in layer.modules():
            index = getattr(module, "layer_idx", 0)
            unindexed = index is None or (isinstance(index, int) and index < 0)
            if unindexed and type(module).__name__.endswith("Attention"):
                holders.setdefault(module, set()).add(i)
    for module, indices in holders.items():
        if len(indices) == 1:
            module.layer_idx = indices.pop()  # type: ignore[assignment]  # (nn.Module types attributes as tensors)


def _first_line(exc: BaseException) -> str:
    """`Type: message` of an exception, its message cut to the first line (transformers' load reports run long)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def _install_state_layers(model, model_config) -> None:
    """Wrap the layers that keep a state (state_layers.py); refuse a model whose config names state
    layers that keep it some other way (genq could not give each sequence its own)."""
    wrapped = state_layers.install(model)
    layer_types = set(getattr(model_config.get_text_config(decoder=True), "layer_types", None) or ())
    stateful = layer_types & (STATE_LAYER_TYPES - {"mlp", "moe"})
    if stateful and not wrapped:
        where = next((STATE_OUTSIDE_CACHE[type(m).__name__] for m in model.modules() if type(m).__name__ in
                      STATE_OUTSIDE_CACHE), None)  # fmt: skip
        raise refusal(
            model_config.model_type,
            f"its layers of types {sorted(stateful)} keep their state outside transformers' cache API "
            "(get_conv_state/get_recurrent_state), where genq cannot give each sequence its own"
            + (f": {where}" if where else ""),
        )


def use_eager_experts(model) -> None:
    """Mixture-of-experts layers default to grouped matmuls, which refuse float64: loop over experts."""
    try:
        model.set_experts_implementation("eager")
    except (ValueError, AttributeError, NotImplementedError):
        pass  # no experts, or no choice of implementation


def build_tiny_llama(model_config):
    """Deterministic random weights: the same model on every machine, no download."""
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(20261121)
        model = LlamaForCausalLM(model_config)
    return model


def load_tokenizer_for(config: EngineConfig):
    return load_tokenizer(config.model, config.revision, config.trust_remote_code)
