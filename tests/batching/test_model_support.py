"""Every decoder architecture of the installed transformers runs token-identical or is refused at load.

tools/model_support.py builds each model type tiny (float64, wide weights) and compares genq with
`model.generate()` under two schedules; here each type is one test. A refusal must name the model
type and say what genq lacks; a divergence or a crash fails. The sensitivity controls show that the
walk would see a sliding window, a soft-cap or attention sinks being ignored.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

from batching.model_probe import MaskPattern, MaskProbe, MaskUsed
from tools import model_support as support

MODEL_TYPES = support.decoder_model_types()
MODELS_DOC = (
    Path(__file__).resolve().parents[2] / "docs" / "models.md"
)  # its model table: python -m tools.model_support


def documented_statuses() -> dict[str, str]:
    """model type -> status, from the docs' table (rows `| type | status | why |`)."""
    rows = re.findall(
        r"^\| (\w+) \| (identical|refused|crashed|diverged|untested) \|", MODELS_DOC.read_text(), re.M
    )
    return dict(rows)


DOCUMENTED = documented_statuses()


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_runs_identically_or_is_refused_at_load(model_type, tmp_path):
    with support.quiet():
        result = support.check_model_type(model_type, str(tmp_path))
    if result.status == "untested":
        # transformers itself cannot build or generate with it tiny; never a type the docs list as running
        assert DOCUMENTED.get(model_type) != "identical", (
            f"the docs list {model_type} as running: {result.reason}"
        )
        pytest.skip(result.reason)
    if DOCUMENTED.get(model_type) == "identical":  # what the docs promise runs must keep running
        assert result.status == "identical", f"the docs list {model_type} as running: {result.reason}"
    assert result.status in ("identical", "refused"), result.reason
    if result.status == "refused":
        assert f"genq cannot run {model_type}" in result.reason, result.reason


def test_the_docs_table_is_read():
    assert DOCUMENTED.get("llama") == "identical" and sum(s == "identical" for s in DOCUMENTED.values()) > 50


def _break_llama_mlp(monkeypatch, exc: Exception, where=None) -> None:
    """Llama's MLP raises `exc` in genq's steps where `where()` holds (default: every genq step);
    generate() still gives the reference."""
    from transformers.models.llama import modeling_llama

    from batching.attention import current_step

    mlp_forward = modeling_llama.LlamaMLP.forward

    def broken(self, x):
        if current_step() is not None and (where is None or where()):
            raise exc
        return mlp_forward(self, x)

    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", broken)


def _none_attribute() -> AttributeError:
    """The AttributeError a genq bug reading an attribute of None raises: 'NoneType' object has no ..."""
    try:
        None.block_table  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as exc:
        return exc
    raise AssertionError("unreachable")


@pytest.mark.parametrize(
    "planted",
    [
        RuntimeError("planted failure inside the forward"),
        _none_attribute(),  # what the probe once took for a model reading the mask, whatever raised it
        TypeError("planted: 'MaskProbe' object is not subscriptable"),  # the probe's name, not its mask
    ],
    ids=["runtime_error", "nonetype_attribute", "maskprobe_in_message"],
)
def test_a_forward_that_raises_is_a_crash_with_its_traceback_not_a_refusal(
    planted, tmp_path, monkeypatch, caplog
):
    """A bug that breaks a supported architecture in genq (here: an exception inside Llama's MLP when
    genq runs it) reads as a crash, with the traceback in the log, so the walk above fails on it,
    whatever its message says."""
    _break_llama_mlp(monkeypatch, planted)
    with caplog.at_level(logging.ERROR, logger="batching.model_probe"):
        with support.quiet():
            result = support.check_model_type("llama", str(tmp_path))
    assert result.status == "crashed", result
    assert str(planted) in result.reason and "computes with the attention mask" not in result.reason
    assert "Traceback" in caplog.text and str(planted) in caplog.text


def test_a_model_computing_with_the_mask_is_refused_without_a_traceback(tmp_path, caplog):
    """Doge builds its dynamic attention mask from the mask transformers hands its attention layer, which
    genq does not build: the probe's mask raises where Doge's code reads it, and that is the documented
    refusal (no traceback logged), naming the line that read it."""
    with caplog.at_level(logging.ERROR):
        with support.quiet():
            result = support.check_model_type("doge", str(tmp_path))
    assert result.status == "refused", result
    assert "genq cannot run doge: it computes with the attention mask in its own code" in result.reason
    assert "modeling_doge.py:" in result.reason and "prepare_dynamic_mask: reads mask.dtype" in result.reason
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_a_mask_use_the_model_wraps_in_an_error_of_its_own_is_still_the_refusal(tmp_path, monkeypatch):
    """The probe recognises the mask's use anywhere in the exception's chain, not by its message."""
    from transformers.models.doge import modeling_doge

    prepare = modeling_doge.DogeAttention.prepare_dynamic_mask

    def wrapping(self, *args, **kwargs):
        try:
            return prepare(self, *args, **kwargs)
        except AttributeError as exc:
            raise RuntimeError("dynamic mask failed") from exc

    monkeypatch.setattr(modeling_doge.DogeAttention, "prepare_dynamic_mask", wrapping)
    with support.quiet():
        result = support.check_model_type("doge", str(tmp_path))
    assert result.status == "refused" and "prepare_dynamic_mask: reads mask.dtype" in result.reason, result


@pytest.mark.parametrize(
    "use,says",
    [
        (lambda m: m.dtype, "reads mask.dtype"),
        (lambda m: m[:, :, :, :4].shape, "reads mask.shape"),  # sliced first, as modules do
        (lambda m: torch.zeros(4) + m, "passes the mask to add()"),
        (lambda m: torch.where(m, 0.0, -1.0), "passes the mask to where()"),
        (lambda m: m != 0, "applies __ne__ to the mask"),
        (lambda m: 1 - m, "applies __rsub__ to the mask"),
        (lambda m: ~m, "applies __invert__ to the mask"),
    ],
    ids=[
        "attribute",
        "sliced_attribute",
        "tensor_operator",
        "torch_function",
        "compare",
        "arithmetic",
        "invert",
    ],
)
def test_the_probe_mask_raises_wherever_code_computes_with_it(use, says):
    probe = MaskProbe(lambda b, h, q, kv: kv <= q)
    with pytest.raises(MaskUsed, match=re.escape(says)):
        use(probe)
    assert probe.allows(2, torch.arange(4)).tolist() == [True, True, True, False]  # its own use still works
    assert not hasattr(probe, "shape") and getattr(probe, "dtype", None) is None  # as for any object


def test_out_of_memory_in_the_probe_is_raised_as_it_is_not_a_refusal(tmp_path, monkeypatch):
    """The device running short of memory while the probe runs says so; it is no verdict on the model."""
    from batching import Engine, EngineConfig

    with support.quiet():
        support.build_tiny_model(support.tiny_config("llama")).save_pretrained(tmp_path)
    _break_llama_mlp(monkeypatch, torch.OutOfMemoryError("planted: CUDA out of memory"))
    with pytest.raises(torch.OutOfMemoryError, match="planted"):
        Engine(EngineConfig(model=str(tmp_path), dtype="float64", device="cpu", max_model_len=64))


def test_a_genq_value_error_outside_the_probe_is_a_crash_not_a_refusal(tmp_path, monkeypatch, caplog):
    """Only genq's Refusal is a refusal: a ValueError raised while genq serves (after the load-time
    probe passed) is a crash, with its traceback logged by the walk."""
    from batching import model_probe

    planted = ValueError("planted ValueError while serving")
    _break_llama_mlp(monkeypatch, planted, where=lambda: model_probe._recorder is None)
    with caplog.at_level(logging.ERROR, logger="tools.model_support"):
        with support.quiet():
            result = support.check_model_type("llama", str(tmp_path))
    assert result.status == "crashed" and "planted ValueError while serving" in result.reason, result
    assert "Traceback" in caplog.text and "planted ValueError while serving" in caplog.text


def test_a_forward_that_fails_in_generate_too_is_untested_not_a_genq_crash(tmp_path, monkeypatch):
    """The model's own failure (its generate() fails the same way, as inkling2's float32 router does
    in a float64 model) is no genq bug: untested, which the walk accepts only for types the docs do
    not list as running."""
    from transformers.models.llama import modeling_llama

    def broken(self, x):
        raise RuntimeError("planted failure everywhere")

    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", broken)
    with support.quiet():
        result = support.check_model_type("llama", str(tmp_path))
    assert result.status == "untested" and "planted failure everywhere" in result.reason, result


def test_the_walk_covers_the_families_genq_runs():
    """The walk is not vacuous: it knows the popular decoders (and the engine runs them, above)."""
    for model_type in ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gpt2", "deepseek_v3", "gpt_oss"):
        assert model_type in MODEL_TYPES


def _reference(model_type: str, switch_off=None, **overrides) -> list[list[int]]:
    with support.quiet():
        model = support.build_tiny_model(support.tiny_config(model_type, **overrides))
        if switch_off is not None:
            switch_off(model)
        return support.reference_tokens(model, support.prompts())


def _no_sinks(model) -> None:
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.fill_(float("-inf"))  # a sink of -inf takes no probability mass


@pytest.mark.parametrize(
    "model_type,switch_off,overrides",
    [
        ("mistral", None, dict(sliding_window=None)),  # the window
        ("gemma2", None, dict(attn_logit_softcapping=None)),  # the attention soft-cap
        ("gpt_oss", _no_sinks, {}),  # the attention sinks
    ],
    ids=["sliding_window", "softcap", "sinks"],
)
def test_features_the_walk_checks_change_the_reference(model_type, switch_off, overrides):
    """Were genq to ignore the feature, its tokens would differ from generate()'s, and the walk fail."""
    assert _reference(model_type) != _reference(model_type, switch_off, **overrides)


@pytest.mark.parametrize(
    "model_type,expected",
    [("phimoe", MaskPattern(window=12)), ("llama4_text", MaskPattern(chunk=16))],
)
def test_windows_and_chunks_only_the_mask_expresses_are_read_from_it(model_type, expected, tmp_path):
    """phimoe passes no sliding_window to its attention, llama4 no chunk size: genq reads both off
    the mask transformers builds, and applies them (the walk above shows the tokens then match)."""
    from batching import Engine, EngineConfig

    with support.quiet():
        support.build_tiny_model(support.tiny_config(model_type)).save_pretrained(tmp_path)
        engine = Engine(EngineConfig(model=str(tmp_path), dtype="float64", device="cpu", max_model_len=128))
    assert expected in engine.runner.mask_patterns.values()


def test_kv_shared_across_layers_runs_identically(tmp_path):
    """gemma4's last layers reuse an earlier layer's K/V (not in the two-layer walk): each keeps
    its own copy in genq's cache, written from the K/V the model hands it, and the tokens match."""
    with support.quiet():
        result = support.check_model_type(
            "gemma4_text",
            str(tmp_path),
            num_hidden_layers=3,
            layer_types=["sliding_attention", "full_attention", "full_attention"],
            num_kv_shared_layers=1,
        )
    assert result.status == "identical", result.reason


@pytest.mark.parametrize(
    "overrides,kv_heads",
    [
        (dict(new_decoder_architecture=True, num_kv_heads=2), 2),  # Falcon-40B/180B: grouped K/V
        (dict(multi_query=False, num_kv_heads=4, parallel_attn=False), 4),  # Falcon-RW: one K/V per head
    ],
    ids=["grouped_kv", "multi_head_sequential"],
)
def test_falcon_variants_run_identically(overrides, kv_heads, tmp_path):
    """The walk builds Falcon's default (multi-query, parallel attention); its other layouts run too,
    and grouped K/V, which Falcon broadcasts to every query head, are cached once per group."""
    from batching import Engine, EngineConfig

    with support.quiet():
        result = support.check_model_type("falcon", str(tmp_path), **overrides)
        assert result.status == "identical", result.reason
        engine = Engine(EngineConfig(model=str(tmp_path), dtype="float64", device="cpu", max_model_len=64))
    assert {g.num_kv_heads for g in engine.kv_cache.layers} == {kv_heads}


@pytest.mark.parametrize(
    "model_type,overrides", [("falcon", dict(alibi=True)), ("bloom", {}), ("mpt", {})], ids=str
)
def test_alibi_models_are_refused_with_the_reason(model_type, overrides, tmp_path):
    """ALiBi is added inside these models' own attention code, where no transformers hook reaches."""
    with support.quiet():
        result = support.check_model_type(model_type, str(tmp_path), **overrides)
    assert result.status == "refused"
    assert f"genq cannot run {model_type}: it adds ALiBi position biases" in result.reason


def test_gpt_neo_local_window_changes_the_reference():
    """GPT-Neo keeps its local layers' window in a buffer of its own, not in the mask transformers
    builds: the walk's tiny GPT-Neo has one local layer whose window the prompts pass."""
    assert _reference("gpt_neo") != _reference("gpt_neo", attention_types=[[["global"], 2]])


def test_the_probe_checks_the_attention_of_class_table_models(monkeypatch, tmp_path):
    """genq's GPT-J class is what the load-time probe checks: were it to attend wrongly (here, without
    GPT-J's 1/sqrt(head size)), the engine would refuse the model at load, not serve wrong tokens."""
    from batching import Engine, EngineConfig, attention_classes

    cls = attention_classes.genq_class("gptj")

    def unscaled(self, query, key, value, attention_mask=None):
        if not self.routed:
            return super(cls, self)._attn(query, key, value, attention_mask)
        return self.interface_attention(query, key, value, attention_mask, scaling=1.0).transpose(1, 2), None

    monkeypatch.setattr(cls, "_attn", unscaled)
    with support.quiet():
        support.build_tiny_model(support.tiny_config("gptj")).save_pretrained(tmp_path)
        with pytest.raises(
            ValueError, match="genq cannot run gptj: its logits on genq's paged attention differ"
        ):
            Engine(EngineConfig(model=str(tmp_path), dtype="float64", device="cpu", max_model_len=64))


def test_a_class_table_without_a_genq_class_is_refused_with_the_reason(monkeypatch, tmp_path):
    """A model type with its own attention-class table that genq has no class for (as falcon, gptj and
    gpt_neo were) is refused by name, not with transformers' KeyError."""
    from transformers.models.gptj import modeling_gptj

    from batching import Engine, EngineConfig, attention_classes
    from batching.attention import ATTENTION_NAME

    monkeypatch.delitem(attention_classes.TABLES, "gptj")
    monkeypatch.delitem(modeling_gptj.GPTJ_ATTENTION_CLASSES, ATTENTION_NAME, raising=False)
    with support.quiet():
        support.build_tiny_model(support.tiny_config("gptj")).save_pretrained(tmp_path)
        with pytest.raises(
            ValueError, match="genq cannot run gptj: it picks its attention class from its own table"
        ):
            Engine(EngineConfig(model=str(tmp_path), dtype="float64", device="cpu", max_model_len=64))


def test_two_engines_stepping_at_once_each_see_their_own_step(tmp_path):
    """GPT-J's attention reads the step's metadata from the runner's context variable, not from a
    global: two engines stepping at the same time in two threads (as two engine hosts in one process
    would) each attend over their own cache, and both match generate()."""
    import threading

    from batching import Engine, EngineConfig, SamplingParams

    with support.quiet():
        model = support.build_tiny_model(support.tiny_config("gptj"))
        model.save_pretrained(tmp_path)
        expected = support.reference_tokens(model, support.prompts())
        engines = [
            Engine(EngineConfig(model=str(tmp_path), dtype="float64", device="cpu", max_model_len=128, **s))
            for s in support.SCHEDULES
        ]
    params = SamplingParams(max_tokens=support.MAX_NEW, temperature=0, ignore_eos=True)
    start = threading.Barrier(len(engines))
    results: dict[int, object] = {}

    def run(i: int, engine) -> None:
        start.wait()
        try:
            results[i] = [o.token_ids for o in engine.generate(support.prompts(), params)]
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, e)) for i, e in enumerate(engines)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: expected for i in range(len(engines))}


HYBRIDS = ["linear_attention", "hybrid", "linear_attention", "hybrid", "hybrid", "linear_attention"]


@pytest.mark.parametrize(
    "model_type,overrides",
    [
        ("zamba", dict(num_hidden_layers=6, layers_block_type=HYBRIDS)),
        # two blocks of weights over three hybrid layers: layers 1 and 4 run the same block's weights
        (
            "zamba2",
            dict(
                num_hidden_layers=6, layers_block_type=HYBRIDS, hybrid_layer_ids=[1, 3, 4], num_mem_blocks=2
            ),
        ),
    ],
)
def test_zambas_attention_blocks_keep_their_kv_under_their_own_layer(model_type, overrides, tmp_path):
    """Zamba's and Zamba2's attention blocks carry no layer index of their own (None, -1): genq gives each the
    index of the hybrid layer that holds it, so three hybrid layers keep three layers of KV, and the tokens are
    generate()'s (the walk above has one hybrid layer only)."""
    from batching import Engine, EngineConfig

    with support.quiet():
        result = support.check_model_type(model_type, str(tmp_path), **overrides)
        engine = Engine(EngineConfig(model=str(tmp_path), dtype="float64", device="cpu", max_model_len=64))
    assert result.status == "identical", result.reason
    assert [i for i, g in enumerate(engine.kv_cache.layers) if g is not None] == [1, 3, 4]


@pytest.mark.parametrize(
    "model_type,change",
    [
        (
            "recurrent_gemma",
            "transformers would have to keep both in the cache passed to the forward, by layer index",
        ),
        ("minimax", "transformers would have to keep it through the cache API's get_recurrent_state"),
    ],
)
def test_a_state_kept_outside_the_cache_api_is_refused_naming_what_transformers_would_change(
    model_type, change, tmp_path
):
    from batching import Engine, EngineConfig

    with support.quiet():
        support.build_tiny_model(support.tiny_config(model_type)).save_pretrained(tmp_path)
        with pytest.raises(ValueError) as refused:
            Engine(EngineConfig(model=str(tmp_path), dtype="float64", device="cpu", max_model_len=64))
    assert f"genq cannot run {model_type}: its layers of types ['linear_attention'] keep their state" in str(
        refused.value
    )
    assert change in str(refused.value)
