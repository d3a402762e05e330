"""Tiny random checkpoints saved to disk (real local-path loading), and reference generations."""

from __future__ import annotations

import functools
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:  # the CUDA path's Triton kernel runs under Triton's interpreter (set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from batching import Engine, EngineConfig  # noqa: E402
from batching.tokenizer import BOS_ID, EOS_ID, byte_level_tokenizer  # noqa: E402

# The ways an engine runs (attention_metadata.py): the exactness tests (parity, preemption, swap,
# prefix cache) run on each one this machine has. The C++ kernels and torch on the CPU always;
# on a CUDA machine the Triton kernel (with CUDA graphs for decodes) and torch on the device.
# GENQ_TEST_PATHS (comma-separated names) picks some (`make gpu-check` picks the CUDA ones).
# "-async": the next step scheduled while this one's tokens are still on the device (engine.py; on by
# default with CUDA, so the CUDA torch path runs without it).
ENGINE_PATHS = {
    "cpu-kernel": dict(device="cpu", attention_backend="cpu_kernel"),
    "cpu-kernel-async": dict(device="cpu", attention_backend="cpu_kernel", async_scheduling=True),
    "cpu-torch": dict(device="cpu", attention_backend="torch"),
}
if CUDA:
    ENGINE_PATHS["cuda-triton"] = dict(device="cuda", attention_backend="triton")
    ENGINE_PATHS["cuda-torch"] = dict(device="cuda", attention_backend="torch", async_scheduling=False)
if os.environ.get("GENQ_TEST_PATHS"):
    ENGINE_PATHS = {name: ENGINE_PATHS[name] for name in os.environ["GENQ_TEST_PATHS"].split(",")}
# Triton's kernel is slow under the interpreter: the tests in test_attention_paths.py run it on a
# chosen few models and schedules, on the CPU; on CUDA it is one of ENGINE_PATHS.
TRITON_PATH = (
    ("cuda-triton", dict(device="cuda", attention_backend="triton"))
    if CUDA
    else ("cpu-triton", dict(device="cpu", attention_backend="triton"))
)

VOCAB = 259  # the byte-level tokenizer's size

TINY_CONFIGS = {
    "llama": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    ),
    "qwen2": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        use_sliding_window=False,
    ),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=1024),
    # variants that exercise sliding windows and logit soft-capping
    "mistral": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        sliding_window=12,
    ),
    "gemma2": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        sliding_window=12,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=16,
    ),
}


def make_checkpoint(model_type: str, directory) -> str:
    cfg = AutoConfig.for_model(
        model_type,
        vocab_size=VOCAB,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=0,
        initializer_range=0.25,
        tie_word_embeddings=False,
        **TINY_CONFIGS[model_type],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(directory)
    byte_level_tokenizer().save_pretrained(directory)
    return str(directory)


@pytest.fixture(autouse=True)
def collect_cuda_engines():
    """On CUDA, free each test's engines before the next test sizes its pools from free memory (an
    engine is collected by the garbage collector, not at once: its runner and graphs refer to each other)."""
    yield
    if CUDA:
        import gc

        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread():
    """These models are tiny: one intra-op thread is ~10x faster than two, and on a shared 2-core
    machine extra threads spin against other processes (a step went from 2 ms to 200 ms)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(model_type) -> path of a saved tiny random model with tokenizer."""

    @functools.cache
    def make(model_type: str) -> str:
        return make_checkpoint(model_type, tmp_path_factory.mktemp(model_type))

    return make


@pytest.fixture(scope="session")
def reference():
    """reference(path, prompt_ids, max_new_tokens) -> greedy tokens of HF generate() in float64."""
    models = {}

    @functools.cache
    def generate(path: str, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
        if path not in models:
            models[path] = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float64, attn_implementation="eager"
            ).eval()
        model = models[path]
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        return out[0, len(prompt) :].tolist()

    return generate


@pytest.fixture(scope="session")
def tiny_engine():
    """The built-in tiny-llama engine in float32 on the CPU (shared; tests must leave it idle)."""
    return Engine(EngineConfig(model="tiny-llama", dtype="float32", device="cpu"))


def run_to_completion(engine: Engine, check_invariants: bool = True) -> dict:
    """Step until idle, checking block invariants after every step; returns final outputs by id."""
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if check_invariants:
            engine.check_invariants()
    assert engine.block_manager.num_free_device_blocks == engine.block_manager.num_device_blocks
    assert engine.block_manager.num_free_host_blocks == engine.block_manager.num_host_blocks
    return finished


def random_prompts(seed: int, lengths) -> list[list[int]]:
    """Prompts of random byte tokens (ids 3.. so no special token), one per length."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def greedy(max_tokens: int, **kwargs):
    from batching import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kwargs)


@pytest.fixture(scope="session")
def llama_path(checkpoint) -> str:
    return checkpoint("llama")


@pytest.fixture(scope="module", params=list(ENGINE_PATHS))
def engine_path(request) -> dict:
    """The EngineConfig fields of one way to run (ENGINE_PATHS): the test runs once per way."""
    return ENGINE_PATHS[request.param]


@pytest.fixture(scope="module")
def make_engine(llama_path, engine_path):
    """make_engine(**config) -> an Engine over the tiny llama checkpoint in float64, on each engine path."""

    def make(**kwargs) -> Engine:
        kwargs.setdefault("model", llama_path)
        kwargs.setdefault("dtype", "float64")
        return Engine(EngineConfig(**(engine_path | kwargs)))

    return make


@pytest.fixture(scope="session")
def make_cpu_engine(llama_path):
    """make_cpu_engine(**config) -> an Engine over the tiny llama checkpoint in float64 on the CPU's
    default path: for tests of scheduling and accounting, which do not depend on the path."""

    def make(**kwargs) -> Engine:
        kwargs.setdefault("model", llama_path)
        kwargs.setdefault("dtype", "float64")
        kwargs.setdefault("device", "cpu")
        return Engine(EngineConfig(**kwargs))

    return make
