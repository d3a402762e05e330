"""Engine configuration: one validated dataclass."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("auto", "float32", "float64", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
PREEMPTION_MODES = ("swap", "recompute")
ATTENTION_BACKENDS = ("auto", "triton", "cpu_kernel", "torch")
SCHEDULING_POLICIES = ("fcfs", "predicted", "preemptive")
KV_CACHE_DTYPES = ("auto", "int8")


@dataclass(slots=True)
class EngineConfig:
    model: str = "tiny-llama"  # HF id, local path, or the built-in "tiny-llama"
    dtype: str = "auto"  # "auto": the checkpoint's dtype on CUDA, float32 on the CPU
    device: str = "auto"  # "auto": CUDA when present
    # "auto": K/V stored in the model's dtype (exact); "int8": 8 bits per element with a scale per token and KV
    # head (kv_cache.py), about twice the sequences of a 16-bit cache in the same memory, and approximate:
    # tokens may differ from generate()'s (docs/models.md#8-bit-kv-cache has the measured error)
    kv_cache_dtype: str = "auto"
    block_size: int = 16  # tokens per KV block
    num_device_blocks: int | None = None  # None: sized from free memory
    num_host_blocks: int | None = None  # 0 disables swap; None: as many as device blocks (capped by memory)
    max_num_seqs: int = 256  # vLLM's default: a queue of hundreds starts at once (bench/serve_vs_vllm.py)
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    preemption_mode: str = "swap"
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True  # reuse the KV of full blocks of a prefix seen before
    attention_aware_chunks: bool = (
        True  # a chunk deep in a long prompt counts its attention against the budget
    )
    cpu_attention_kernel: bool = (
        True  # CPU: attend from the KV blocks in place with csrc/ (built on first use)
    )
    # "auto": the Triton kernel on CUDA, the C++ kernels on the CPU (if cpu_attention_kernel), else
    # torch; "triton" on the CPU runs only under TRITON_INTERPRET=1 (the suite's check of the CUDA path)
    attention_backend: str = "auto"
    # schedule and pack the next step while the device runs this one; its tokens stay on the device as the
    # next step's inputs (engine.py). None: on with CUDA (on the CPU the forward runs in the caller's thread)
    async_scheduling: bool | None = None
    cuda_graphs: bool = True  # CUDA: replay captured graphs of the forward (decode and mixed steps)
    cpu_packed_linears: bool = (
        True  # CPU float32/bfloat16: linear layers through oneDNN, weights packed once (cpu_linear.py)
    )
    # CPU: Llama, Mistral, Qwen2 and Qwen3 decoder layers with merged q/k/v and gate/up products and their
    # element-wise ops in C++ passes (fused_layers.py); other layers run as transformers wrote them
    cpu_fused_layers: bool = True
    # order of waiting sequences within a priority class (admission_order.py): "fcfs" by arrival; "predicted"
    # (bench/within_class.py: mean latency 0.25x fcfs's) by arrival + predicted cost (uncomputed prompt +
    # predicted output tokens) x cost_seconds_per_token, that shift capped at aging_seconds, deadlines at risk
    # first (earliest first); "preemptive": predicted, and a running sequence yields to waiting ones of its class
    # that have made fewer tokens (least attained service, scheduler.py)
    scheduling_policy: str = "predicted"
    aging_seconds: float = 30.0  # the most a place moves back: overtaken only by arrivals this much later
    # predicted tokens to seconds of place; also the step time assumed until steps are measured
    cost_seconds_per_token: float = 0.02
    deadline_margin_seconds: float = 5.0  # a deadline is at risk with less slack than this
    memory_utilization: float = 0.9  # share of free device memory the KV cache may take when sizing
    # ranks the model is sharded over (attention heads, MLP and KV cache; tensor_parallel.py): 1 runs in this
    # process alone; N > 1 spawns N - 1 rank processes beside it (one GPU each on CUDA, gloo on the CPU)
    tensor_parallel_size: int = 1
    seed: int = 0  # base of the random seeds of unseeded sampled requests
    revision: str | None = None  # model revision for HF ids
    trust_remote_code: bool = False

    def __post_init__(self):
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("model must be a non-empty string (an HF id, a local path or 'tiny-llama')")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be one of {DEVICES} (or 'cuda:N'), got {self.device!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        _check_int("block_size", self.block_size, 1)
        if self.num_device_blocks is not None:
            _check_int("num_device_blocks", self.num_device_blocks, 1)
        if self.num_host_blocks is not None:
            _check_int("num_host_blocks", self.num_host_blocks, 0)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 2)
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
        if not isinstance(self.enable_chunked_prefill, bool):
            raise ValueError(
                f"enable_chunked_prefill must be True or False, got {self.enable_chunked_prefill!r}"
            )
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}"
            )
        if not isinstance(self.attention_aware_chunks, bool):
            raise ValueError(
                f"attention_aware_chunks must be True or False, got {self.attention_aware_chunks!r}"
            )
        if not isinstance(self.cpu_attention_kernel, bool):
            raise ValueError(f"cpu_attention_kernel must be True or False, got {self.cpu_attention_kernel!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(
                f"async_scheduling must be None (auto), True or False, got {self.async_scheduling!r}"
            )
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be True or False, got {self.cuda_graphs!r}")
        if not isinstance(self.cpu_packed_linears, bool):
            raise ValueError(f"cpu_packed_linears must be True or False, got {self.cpu_packed_linears!r}")
        if not isinstance(self.cpu_fused_layers, bool):
            raise ValueError(f"cpu_fused_layers must be True or False, got {self.cpu_fused_layers!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}"
            )
        _check_seconds("aging_seconds", self.aging_seconds)
        _check_seconds("cost_seconds_per_token", self.cost_seconds_per_token)
        _check_seconds("deadline_margin_seconds", self.deadline_margin_seconds)
        if (
            isinstance(self.memory_utilization, bool)
            or not isinstance(self.memory_utilization, (int, float))
            or not 0.0 < self.memory_utilization <= 1.0
        ):
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.memory_utilization!r}")
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        if self.tensor_parallel_size > 1 and self.async_scheduling:
            raise ValueError(
                "async_scheduling: the ranks of tensor_parallel_size > 1 need each step's input tokens on the "
                "host (the step's broadcast), so it runs with async_scheduling off (None or False)"
            )
        _check_int("seed", self.seed, 0)
        if self.revision is not None and (not isinstance(self.revision, str) or not self.revision):
            raise ValueError(f"revision must be a non-empty string or None, got {self.revision!r}")
        if not isinstance(self.trust_remote_code, bool):
            raise ValueError(f"trust_remote_code must be True or False, got {self.trust_remote_code!r}")


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_seconds(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
