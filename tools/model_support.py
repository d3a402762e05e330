"""Which decoder architectures genq runs, checked against the installed transformers.

For every model type transformers can load as a causal LM, build a tiny random model (two layers,
float64, weights wide enough that the next token depends on the context), then run genq on mixed
prompt lengths under two schedules (a tiny token budget with 16-token blocks; 1-token blocks) and
compare with `model.generate()`. Each type ends in one of:

  identical  genq's greedy tokens equal generate()'s on every prompt, under both schedules
  refused    the engine refuses it at load, for a reason the probe knows (the message says which)
  crashed    genq raised something other than a refusal it knows (model_probe.Refusal): an exception in
             the model's forward on genq's inputs at load, or anywhere else in genq (the traceback is
             logged): a genq bug or the model's; never counted as a clean refusal (the test fails on it)
  diverged   genq ran but its tokens differ: a bug (the test fails on it)
  untested   no tiny model or no reference could be built here (the reason says which), or the
             model's forward fails in generate() and in genq alike

    python -m tools.model_support            # the Markdown table for docs/models.md (a few minutes)
    python -m tools.model_support llama gpt2 # some types only
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import random
import sys
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from batching.model_probe import Refusal

log = logging.getLogger(__name__)

VOCAB = 259  # the byte-level tokenizer's ids, so ids 3.. are ordinary tokens in every tiny model
MAX_NEW = 8
PROMPT_LENGTHS = (1, 3, 9, 21, 40)
SCHEDULES = (  # (max_num_batched_tokens, block_size): chunked prefill mixed with decodes, then 1-token blocks
    dict(max_num_batched_tokens=7, block_size=16, max_num_seqs=3),
    dict(max_num_batched_tokens=64, block_size=1, max_num_seqs=8),
)
MAX_PARAMETERS = 5_000_000  # a tiny config that is not tiny (sizes under unusual names) is skipped
WEIGHT_STD = 0.2  # default inits (~0.02) make tiny models repeat their input whatever the context

# the size of every tiny model, under each name configs use for it; only names a config has are set
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    n_embd=64,
    d_model=64,
    intermediate_size=128,
    n_inner=128,
    ffn_dim=128,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    moe_shared_expert_intermediate_size=32,
    num_hidden_layers=2,
    decoder_layers=2,
    encoder_layers=2,
    decoder_ffn_dim=128,
    encoder_ffn_dim=128,
    decoder_attention_heads=4,
    encoder_attention_heads=4,
    n_layer=2,
    num_layers=2,
    num_attention_heads=4,
    n_head=4,
    num_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    # multi-head latent attention (DeepSeek-V2/V3 and kin): K and V of different head sizes
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    qk_head_dim=32,
    v_head_dim=16,
    # gated delta nets (qwen3_next, qwen3_5, olmo_hybrid): their short convolution spans every channel of
    # q, k and v, and a float64 depthwise convolution costs ~6 us per channel on a CPU
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    # per-layer inputs and head sizes (gemma3n, gemma4)
    vocab_size_per_layer_input=VOCAB,
    hidden_size_per_layer_input=16,
    global_head_dim=32,
    rotary_dim=8,  # partial rotary (gptj, codegen)
    # windows and chunks shorter than the prompts, so that losing one changes the output
    sliding_window=12,
    attn_logit_softcapping=2.0,  # gemma2: a cap the tiny scores reach
    use_sliding_window=True,
    attention_chunk_size=16,
    max_position_embeddings=256,
    n_positions=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
    use_cache=True,
)

MAMBA2_TINY = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16)
PER_TYPE: dict[str, dict[str, Any]] = {  # what a type needs beyond TINY to be consistent at two layers
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=12),
    # hybrids: one state layer, then one attention layer (their defaults put attention past layer 2)
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  mamba_dt_rank=8, mamba_d_state=8),
    "bamba": dict(attn_layer_indices=[1], **MAMBA2_TINY),
    "falcon_h1": dict(mamba_d_ssm=128, **MAMBA2_TINY),  # attention and Mamba-2 side by side in each layer
    "nemotron_h": dict(mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=1, chunk_size=16),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"], **MAMBA2_TINY),
    "mamba2": dict(num_heads=8, head_dim=16, state_size=16, n_groups=1, chunk_size=16),
    "zamba": dict(layers_block_type=["linear_attention", "hybrid"], attn_layer_period=2, attn_layer_offset=1,
                  attention_hidden_size=128, attention_head_dim=32, mamba_dt_rank=8, mamba_d_state=8),
    "zamba2": dict(layers_block_type=["linear_attention", "hybrid"], hybrid_layer_ids=[1],
                   attention_hidden_size=128, attention_head_dim=32, kv_channels=16, num_query_groups=4,
                   mamba_headdim=16, n_mamba_heads=8, mamba_d_state=16),
    "zaya": dict(num_experts_per_tok=1),
    "kimi_linear": dict(num_experts_per_token=2, linear_num_heads=4, linear_head_dim=16,
                        mlp_layer_types=["dense", "sparse"]),
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1, num_experts_per_tok=2),
}  # fmt: skip


@dataclass(slots=True)
class Result:
    model_type: str
    status: str  # identical | refused | crashed | diverged | untested
    reason: str = ""


def decoder_model_types() -> list[str]:
    """Every model type the installed transformers maps to a causal-LM class."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str, **overrides):
    """The model type's default config shrunk to two layers of width 64 (plus `overrides`)."""
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type).to_dict()
    sizes = _shrink(defaults)
    sizes.update(PER_TYPE.get(model_type, {}))
    for name in ("text_config", "decoder"):  # composite configs: shrink the text decoder
        if isinstance(defaults.get(name), dict):
            sizes[name] = {**defaults[name], **_shrink(defaults[name]), **overrides}
    return AutoConfig.for_model(model_type, **{**sizes, **overrides})


def _shrink(defaults: dict) -> dict:
    sizes: dict[str, Any] = {k: v for k, v in TINY.items() if k in defaults}
    if "kv_lora_rank" in defaults:  # latent attention expands K and V to every query head
        sizes["num_key_value_heads"] = sizes.get("num_attention_heads", 4)
    layer_types = defaults.get("layer_types")
    if isinstance(layer_types, list) and layer_types:  # one layer of each kind, in order of appearance
        kinds = list(dict.fromkeys(layer_types))
        sizes["layer_types"] = kinds if len(kinds) > 1 else kinds * 2
        for name in ("num_hidden_layers", "n_layer", "num_layers"):
            if name in sizes:
                sizes[name] = len(sizes["layer_types"])
    return sizes


def build_tiny_model(config, seed: int = 0):
    """A float64 random model whose outputs depend on the context (weights drawn wide)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        size = AutoModelForCausalLM.from_config(config).num_parameters()
    if size > MAX_PARAMETERS:
        raise ValueError(f"the tiny config still has {size:,} parameters (sizes under names not shrunk here)")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() >= 2:
                    param.normal_(0.0, WEIGHT_STD)
    return model.eval()


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENGTHS]


def reference_tokens(model, prompt_list: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    """Greedy continuations from transformers' own generate() with eager attention, one prompt at a time."""
    _plain_greedy(model, max_new)
    out = []
    for p in prompt_list:
        ids = torch.tensor([p])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids))
        out.append(gen[0, len(p) :].tolist())
    return out


def reference_generations(
    model, prompt_list: list[list[int]], max_new: int = MAX_NEW
) -> list[tuple[list[int], list[float]]]:
    """As `reference_tokens`, each token with its log probability under the logits generate() chose it
    from (which generate() keeps in float32)."""
    _plain_greedy(model, max_new)
    out = []
    for p in prompt_list:
        ids = torch.tensor([p])
        gen = model.generate(
            ids, attention_mask=torch.ones_like(ids), output_logits=True, return_dict_in_generate=True
        )
        tokens = gen.sequences[0, len(p) :].tolist()
        logits = torch.cat(gen.logits)  # [max_new, V]: row i chose token i
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        out.append((tokens, logprobs.tolist()))
    return out


def _plain_greedy(model, max_new: int) -> None:
    """Eager attention and a fresh generation config: plain greedy, none of the checkpoint's own
    processors (forced EOS, repetition rules)."""
    from transformers import GenerationConfig

    model.set_attn_implementation("eager")
    if model.dtype == torch.float64:
        _eager_experts(model)
    model.generation_config = GenerationConfig(
        max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0
    )


def _eager_experts(model) -> None:
    """Mixture-of-experts layers default to grouped matmuls, which refuse float64."""
    with contextlib.suppress(ValueError, AttributeError, NotImplementedError):
        model.set_experts_implementation("eager")


def engine_tokens(path: str, prompt_list: list[list[int]], max_new: int = MAX_NEW, **options):
    """genq's greedy tokens; `options`: EngineConfig fields (a schedule, device, attention path)."""
    from batching import Engine, EngineConfig, SamplingParams

    options = {"device": "cpu", **options}
    engine = Engine(EngineConfig(model=path, dtype="float64", max_model_len=128, **options))
    params = SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True)
    return [o.token_ids for o in engine.generate(prompt_list, params)]


def check_model_type(
    model_type: str, directory: str, engine_options: dict | None = None, **overrides
) -> Result:
    """Build the tiny model of `model_type` (config `overrides` on top) into `directory` and compare
    genq (its EngineConfig given `engine_options` too: device, attention path) with generate()."""
    try:
        config = tiny_config(model_type, **overrides)
        model = build_tiny_model(config)
        model.save_pretrained(directory)
    except Exception as exc:  # noqa: BLE001 - transformers cannot build it tiny: not genq's to judge
        return Result(model_type, "untested", f"no tiny model: {_short(exc)}")
    prompt_list = prompts()
    try:
        expected = reference_tokens(model, prompt_list)
    except Exception as exc:  # noqa: BLE001 - generate() itself fails: a refusal at load still counts
        expected, no_reference = None, f"no reference from generate(): {_short(exc)}"
    for schedule in SCHEDULES:
        try:
            got = engine_tokens(directory, prompt_list, **schedule, **(engine_options or {}))
        except Refusal as exc:
            reason = _short(exc).replace(directory, "<tiny checkpoint>")
            if exc.unexpected and expected is None:
                # the forward fails in genq as in generate(): the tiny model's own failure, not genq's
                return Result(model_type, "untested", f"{no_reference}; genq's load fails too: {reason}")
            return Result(model_type, "crashed" if exc.unexpected else "refused", reason)
        except Exception as exc:  # noqa: BLE001 - not a refusal genq knows: a crash, with its traceback
            log.error("%s: genq raised under %s", model_type, schedule, exc_info=exc)
            reason = _short(exc).replace(directory, "<tiny checkpoint>")
            return Result(model_type, "crashed", f"under {schedule}: {reason}")
        if expected is None:
            return Result(model_type, "untested", no_reference)
        for p, e, g in zip(prompt_list, expected, got):
            if e != g:
                return Result(
                    model_type, "diverged", f"prompt of {len(p)} tokens under {schedule}: {g} != {e}"
                )
    return Result(model_type, "identical")


def _short(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split()) if not isinstance(exc, Refusal) else str(exc)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run(model_types: list[str], **engine_options) -> list[Result]:
    results = []
    for model_type in model_types:
        with tempfile.TemporaryDirectory() as directory:
            with quiet():
                result = check_model_type(model_type, directory, engine_options)
        print(f"{result.model_type}: {result.status} {result.reason}", file=sys.stderr, flush=True)
        results.append(result)
    return results


def markdown(results: list[Result], where: str = "") -> str:
    import transformers

    counts = {
        s: sum(r.status == s for r in results)
        for s in ("identical", "refused", "crashed", "diverged", "untested")
    }
    lines = [
        f"Checked against transformers {transformers.__version__}{where} by `python -m tools.model_support`: "
        + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        + ".",
        "",
        "| model type | genq | why |",
        "| --- | --- | --- |",
    ]
    for r in results:
        lines.append(f"| {r.model_type} | {r.status} | {r.reason.replace('|', '/')} |")
    return "\n".join(lines)


@contextlib.contextmanager
def quiet():
    """transformers' warnings and progress bars about random tiny models are noise here."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        level = logging.root.manager.disable
        logging.disable(logging.WARNING)
        try:
            yield
        finally:
            logging.disable(level)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_types", nargs="*", help="model types to check (default: all)")
    parser.add_argument("--device", default="cpu", help="where genq runs: cpu (default), cuda, cuda:N")
    parser.add_argument(
        "--attention",
        choices=("kernel", "torch"),
        default="kernel",
        help="CPU attention: the C++ kernels (default) or the torch path that CUDA runs",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    options = dict(device=args.device, cpu_attention_kernel=args.attention == "kernel")
    where = (
        ""
        if args.device == "cpu" and args.attention == "kernel"
        else f" (genq on {args.device}, {args.attention} attention)"
    )
    print(markdown(run(args.model_types or decoder_model_types(), **options), where))


if __name__ == "__main__":
    main()
