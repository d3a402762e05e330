"""Quantized checkpoints (issue 43): each quantization of docs/models.md's table runs token-identical to
`model.generate()` on the same quantized model (float32 on the CPU), or is refused at load with the reason the
table gives. The checkpoints are the tiny llama of conftest.py, quantized here by transformers (torchao
through TorchAoConfig, bitsandbytes through BitsAndBytesConfig) or written in compressed-tensors' or
transformers' fp8 format, and loaded by path like any other; a quantization that cannot be made on this CPU
(its quantizer needs CUDA or a package genq does not install) is a checkpoint whose config.json names it over
plain weights, which is what genq reads to refuse it."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, TorchAoConfig

from batching import Engine, EngineConfig, cpu_linear
from batching.model_probe import Refusal
from tests.batching.conftest import greedy, random_prompts, run_to_completion
from tests.conftest import ROOT

MODELS_DOC = ROOT / "docs" / "models.md"
VERDICTS = ("runs exactly", "refused")


def documented_quantizations() -> dict[str, tuple[str, str]]:
    """quantization -> (verdict, why), from the rows of docs/models.md's quantization table."""
    section = MODELS_DOC.read_text().split("## Quantized checkpoints", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| ([^|]+?) \| (runs exactly|refused) \| ([^|]*?) \|$", section, re.M)
    return {name: (verdict, why) for name, verdict, why in rows}


def torchao_checkpoint(make_config: Callable[[], object]) -> Callable[[str, Path], None]:
    """Quantize the plain checkpoint with a torchao config through transformers, as a user would."""

    def write(plain: str, directory: Path) -> None:
        model = AutoModelForCausalLM.from_pretrained(
            plain, dtype=torch.float32, quantization_config=TorchAoConfig(make_config())
        )
        model.save_pretrained(directory)

    return write


def compressed_tensors_fp8(activations: str | None) -> Callable[[str, Path], None]:
    """compressed-tensors' float-quantized format, written directly: each projection's weight in float8
    (e4m3) with a float32 scale per output channel; `activations` "dynamic": FP8_DYNAMIC's per-token float8
    inputs too, "static": the FP8 preset's inputs at one calibrated scale per projection (llm-compressor's FP8
    recipes write the same tensors and config)."""

    def write(plain: str, directory: Path) -> None:
        import compressed_tensors

        f8max = torch.finfo(torch.float8_e4m3fn).max
        tensors = {}
        for name, weight in load_file(Path(plain) / "model.safetensors").items():
            if name.endswith("proj.weight"):
                scale = weight.abs().amax(dim=1, keepdim=True).float() / f8max  # [out, 1]
                tensors[name] = (weight / scale).to(torch.float8_e4m3fn)
                tensors[name.removesuffix("weight") + "weight_scale"] = scale
                if activations == "static":
                    tensors[name.removesuffix("weight") + "input_scale"] = torch.ones(1)
            else:
                tensors[name] = weight
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
        fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
        inputs = {
            None: None,
            "dynamic": fp8 | {"strategy": "token", "dynamic": True},
            "static": fp8 | {"strategy": "tensor", "dynamic": False},
        }[activations]
        group = {"targets": ["Linear"], "weights": fp8 | {"strategy": "channel", "dynamic": False}}
        _set_quantization_config(
            directory,
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "quantization_status": "compressed",
                "config_groups": {"group_0": group | {"input_activations": inputs}},
                "ignore": ["lm_head"],
                "version": compressed_tensors.__version__,
            },
        )

    return write


def finegrained_fp8_checkpoint(plain: str, directory: Path) -> None:
    """transformers' fine-grained fp8 format, written directly (its quantizer needs a GPU): each projection's
    weight in float8 (e4m3) with a float32 `weight_scale_inv` per 128 x 128 block, as DeepSeek's and Qwen's
    FP8 checkpoints are published; transformers dequantizes them to plain weights on a CPU."""
    f8max = torch.finfo(torch.float8_e4m3fn).max
    block = 128
    tensors = {}
    for name, weight in load_file(Path(plain) / "model.safetensors").items():
        if name.endswith("proj.weight"):
            rows, cols = weight.shape
            scale = torch.empty(-(-rows // block), -(-cols // block))
            quantized = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
            for i in range(scale.shape[0]):
                for j in range(scale.shape[1]):
                    part = weight[i * block : (i + 1) * block, j * block : (j + 1) * block].float()
                    scale[i, j] = part.abs().max() / f8max
                    quantized[i * block : (i + 1) * block, j * block : (j + 1) * block] = (
                        part / scale[i, j]
                    ).to(torch.float8_e4m3fn)
            tensors[name] = quantized
            tensors[name.removesuffix("weight") + "weight_scale_inv"] = scale
        else:
            tensors[name] = weight
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    _set_quantization_config(
        directory,
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [block, block]},
    )


def bitsandbytes_checkpoint(quant_type: str) -> Callable[[str, Path], None]:
    """4-bit weights quantized by bitsandbytes as transformers loads the plain checkpoint (float32 compute),
    saved packed with their quantization state: a pre-quantized checkpoint, as people download them."""

    def write(plain: str, directory: Path) -> None:
        from transformers import BitsAndBytesConfig

        config = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_compute_dtype=torch.float32
        )
        model = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32, quantization_config=config)
        model.save_pretrained(directory)

    return write


def named_in_config(quantization_config: Callable[[], dict]) -> Callable[[str, Path], None]:
    """The plain weights under a config.json that names the quantization (what genq and transformers read
    first)."""

    def write(plain: str, directory: Path) -> None:
        _set_quantization_config(directory, quantization_config())

    return write


def _set_quantization_config(directory: Path, quantization_config: dict) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"] = json.loads(json.dumps(quantization_config, default=str))
    path.write_text(json.dumps(config, indent=2))


def _torchao_config_dict(make_config: Callable[[], object]) -> Callable[[], dict]:
    return lambda: TorchAoConfig(make_config()).to_dict()


def _quant_method_dict(name: str, **kwargs) -> Callable[[], dict]:
    def make() -> dict:
        import transformers

        config = getattr(transformers, name)(**kwargs).to_dict()
        config["quant_method"] = str(getattr(config["quant_method"], "value", config["quant_method"]))
        return config

    return make


def _torchao(name: str, **kwargs) -> Callable[[], object]:
    def make() -> object:
        from torchao import quantization
        from torchao.quantization.granularity import PerGroup

        if "group" in kwargs:
            kwargs["granularity" if name == "IntxWeightOnlyConfig" else "weight_granularity"] = PerGroup(
                kwargs.pop("group")
            )
        return getattr(quantization, name)(**kwargs)

    return make


# the table's rows: how to make each checkpoint
CHECKPOINTS: dict[str, Callable[[str, Path], None]] = {
    "torchao Int8WeightOnlyConfig": torchao_checkpoint(_torchao("Int8WeightOnlyConfig")),
    "torchao IntxWeightOnlyConfig, int4 in groups of 32": torchao_checkpoint(
        _torchao("IntxWeightOnlyConfig", weight_dtype=torch.int4, group=32)
    ),
    "torchao Float8WeightOnlyConfig": torchao_checkpoint(_torchao("Float8WeightOnlyConfig")),
    "compressed-tensors FP8 weights (W8A16, per channel)": compressed_tensors_fp8(activations=None),
    "torchao Int4WeightOnlyConfig": named_in_config(_torchao_config_dict(_torchao("Int4WeightOnlyConfig"))),
    "torchao Int8DynamicActivationInt8WeightConfig": torchao_checkpoint(
        _torchao("Int8DynamicActivationInt8WeightConfig")
    ),
    "torchao Int8DynamicActivationIntxWeightConfig, int4 weights": torchao_checkpoint(
        _torchao("Int8DynamicActivationIntxWeightConfig", weight_dtype=torch.int4)
    ),
    "torchao Float8DynamicActivationFloat8WeightConfig": named_in_config(
        _torchao_config_dict(_torchao("Float8DynamicActivationFloat8WeightConfig"))
    ),
    "compressed-tensors FP8_DYNAMIC (W8A8)": compressed_tensors_fp8(activations="dynamic"),
    "compressed-tensors FP8 (W8A8, static activation scales)": compressed_tensors_fp8(activations="static"),
    "bitsandbytes 8-bit (LLM.int8())": named_in_config(
        _quant_method_dict("BitsAndBytesConfig", load_in_8bit=True)
    ),
    "bitsandbytes 4-bit (nf4)": bitsandbytes_checkpoint("nf4"),
    "bitsandbytes 4-bit (fp4)": bitsandbytes_checkpoint("fp4"),
    "optimum-quanto int8 weights and activations": named_in_config(
        _quant_method_dict("QuantoConfig", weights="int8", activations="int8")
    ),
    "optimum-quanto int8 weights": named_in_config(_quant_method_dict("QuantoConfig", weights="int8")),
    "GPTQ (4-bit)": named_in_config(_quant_method_dict("GPTQConfig", bits=4)),
    "AWQ (4-bit)": named_in_config(_quant_method_dict("AwqConfig", bits=4)),
    "transformers fp8 (FineGrainedFP8Config)": finegrained_fp8_checkpoint,
}
DOCUMENTED = documented_quantizations()
PROMPTS = random_prompts(43, [1, 6, 19, 40])
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def quantized(checkpoint, tmp_path_factory):
    """quantized(name) -> path of the tiny llama quantized as the table's row `name` says."""
    made: dict[str, str] = {}

    def make(name: str) -> str:
        if name not in made:
            directory = tmp_path_factory.mktemp("quantized")
            shutil.copytree(checkpoint("llama"), directory, dirs_exist_ok=True)
            CHECKPOINTS[name](checkpoint("llama"), directory)
            made[name] = str(directory)
        return made[name]

    return make


def generate_reference(
    path: str, prompts: list[list[int]], max_tokens: int, dtype: torch.dtype = torch.float32
) -> list[list[int]]:
    """Greedy tokens of transformers' own generate() on the quantized model (float32 unless `dtype`)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def test_the_table_names_every_quantization_the_suite_makes():
    assert DOCUMENTED, "docs/models.md has no quantization table under '## Quantized checkpoints'"
    assert sorted(DOCUMENTED) == sorted(CHECKPOINTS)
    assert {verdict for verdict, _ in DOCUMENTED.values()} == set(VERDICTS)


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_each_quantization_runs_exactly_or_is_refused_as_the_docs_say(name, quantized):
    verdict, why = DOCUMENTED[name]
    path = quantized(name)
    config = EngineConfig(model=path, dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16)
    if verdict == "refused":
        with pytest.raises(Refusal) as refused:
            Engine(config)
        assert not refused.value.unexpected and "genq cannot run llama" in str(refused.value)
        assert why and why in str(refused.value)
        return
    engine = Engine(config)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, greedy(MAX_TOKENS))
    outputs = run_to_completion(engine)
    expected = generate_reference(path, PROMPTS, MAX_TOKENS)
    assert [outputs[f"r{i}"].token_ids for i in range(len(PROMPTS))] == expected


RUNNING = sorted(name for name, (verdict, _) in DOCUMENTED.items() if verdict == "runs exactly")


@pytest.mark.parametrize("name", RUNNING)
def test_what_runs_stays_exact_under_preemption_and_swap(name, quantized):
    """Low-priority sequences swapped out to the host pool and back while urgent ones run."""
    path = quantized(name)
    engine = Engine(
        EngineConfig(
            model=path,
            dtype="float32",
            device="cpu",
            block_size=2,
            num_device_blocks=24,
            num_host_blocks=64,
            max_num_seqs=3,
            max_num_batched_tokens=16,
            preemption_mode="swap",
        )
    )
    prompts = random_prompts(44, [12, 9, 14, 6, 8])
    for i, prompt in enumerate(prompts[:3]):
        engine.add_request(f"r{i}", prompt, greedy(14), priority=9)
    for _ in range(3):
        engine.step()
    engine.add_request("r3", prompts[3], greedy(14), priority=0)
    engine.add_request("r4", prompts[4], greedy(14), priority=0)
    outputs = run_to_completion(engine)
    assert [outputs[f"r{i}"].token_ids for i in range(5)] == generate_reference(path, prompts, 14)
    stats = engine.stats()
    assert stats["num_preemptions"] >= 1
    assert stats["num_blocks_swapped_in"] == stats["num_blocks_swapped_out"] > 0


def test_the_cpu_linear_path_packs_the_plain_layers_and_leaves_the_quantized_ones(quantized):
    """torchao leaves lm_head plain: oneDNN packs it; the int8 projections keep torchao's own product."""
    engine = Engine(
        EngineConfig(model=quantized("torchao Int8WeightOnlyConfig"), dtype="float32", device="cpu")
    )
    linears = [m for m in engine.model.modules() if isinstance(m, nn.Linear)]
    packed = [m for m in linears if isinstance(m, cpu_linear.PackedLinear)]
    assert packed == [engine.model.lm_head]
    assert all(type(m.weight).__name__ == "Int8Tensor" for m in linears if m is not engine.model.lm_head)


def test_int8_weights_run_exactly_in_float64_too(quantized):
    """torchao's int8 weights multiply activations of any float dtype: float64, genq's dtype of record."""
    path = quantized("torchao Int8WeightOnlyConfig")
    engine = Engine(
        EngineConfig(model=path, dtype="float64", device="cpu", block_size=4, max_num_batched_tokens=16)
    )
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, greedy(MAX_TOKENS))
    outputs = run_to_completion(engine)
    expected = generate_reference(path, PROMPTS, MAX_TOKENS, torch.float64)
    assert [outputs[f"r{i}"].token_ids for i in range(len(PROMPTS))] == expected


@pytest.mark.parametrize(
    "name", ["torchao IntxWeightOnlyConfig, int4 in groups of 32", "torchao Float8WeightOnlyConfig"]
)
def test_weights_that_compute_only_in_their_own_dtype_are_refused_in_another(name, quantized):
    """torchao's intx and float8 weights quantized from float32 multiply float32 activations only: in float64
    the refusal says so and names the dtype to load them in (it was a failure inside the forward before)."""
    with pytest.raises(Refusal) as refused:
        Engine(EngineConfig(model=quantized(name), dtype="float64", device="cpu"))
    assert not refused.value.unexpected
    assert "dequantized to torch.float32) do not multiply torch.float64 activations" in str(refused.value)
    assert "load it with dtype='float32'" in str(refused.value)
