"""genq's engine: continuous batching with chunked prefill, priorities and KV swap over HF models.

Names are imported lazily (PEP 562) so that light modules such as `batching.tokenizer` can be used
(e.g. by the API to count prompt tokens) without importing torch and the model code.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Engine": "batching.engine",
    "EngineConfig": "batching.config",
    "RequestOutput": "batching.outputs",
    "SamplingParams": "batching.sampling_params",
    "TokenLogprob": "batching.logprobs",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'batching' has no attribute {name!r}")
