"""genq's engine: continuous batching with chunked prefill, priorities and KV swap over HF models."""

from batching.config import EngineConfig
from batching.engine import Engine
from batching.outputs import RequestOutput
from batching.sampling_params import SamplingParams

__all__ = ["Engine", "EngineConfig", "RequestOutput", "SamplingParams"]
