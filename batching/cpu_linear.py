"""Linear layers on the CPU through oneDNN, with each weight packed once when the engine is built.

torch's CPU `F.linear` runs float32 on MKL's sgemm. On the AMD EPYC (Zen 5, AVX-512) this project
develops on, MKL takes a slower path than oneDNN (also inside torch, `torch.ops.mkldnn`): a float32
[16, 512] x [512, 2816] product took 572 us against 216 us with the weight in oneDNN's packed layout,
and [512, 512] x [512, 2816] 15.0 ms against 6.6 ms (one thread). In bfloat16 `F.linear` already
goes through oneDNN, but it lays the weight out again on every call: packed once, decode-sized
products run 1.4-2x faster. vLLM's CPU build does the same (oneDNN with prepacked weights).

Once packed, a weight that no other module shares is released: the layer keeps a parameter of the
same shape and dtype (what `model.dtype`, `model.device` and shape checks read) over a single zero,
so the linear weights do not take their memory twice. A weight that another module also holds (an
`lm_head` tied to the embeddings) stays as it is. float64 (which oneDNN does not do)
and float16 keep torch's path. Sums run in another order than MKL's: float32 results differ from
`F.linear` in the last bits, as they already do between batch sizes; greedy tokens stay those of
`model.generate()` unless two logits tie within that noise (the bench reports the prefix match).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

DTYPES = (torch.float32, torch.bfloat16)
PACK_BATCH_HINT = 32  # rows oneDNN lays the weight out for; decode and prefill sizes run alike (1-512)


class PackedLinear(nn.Linear):
    """An `nn.Linear` whose forward multiplies by `packed_weight`, oneDNN's copy of its weight."""

    packed_weight: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_contiguous():
            x = x.contiguous()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def available(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype in packable_dtypes()


def lacks_bf16_arithmetic(dtype: torch.dtype, device: torch.device) -> bool:
    """A bfloat16 model on a CPU where oneDNN has no bf16 path: every product widens first."""
    return device.type == "cpu" and dtype == torch.bfloat16 and dtype not in packable_dtypes()


def packable_dtypes() -> tuple[torch.dtype, ...]:
    """float32 wherever oneDNN is built in; bfloat16 only where oneDNN has a bf16 path on this CPU
    (AVX-512 BW/VL/DQ or AVX-NE-CONVERT: on an AVX2-only CPU the packing itself fails)."""
    if not torch.backends.mkldnn.is_available():
        return ()
    return DTYPES if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)


def plain_weight(weight: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> bool:
    """A weight oneDNN can pack: a plain tensor in one of `dtypes`. A quantized weight is not (torchao's
    int8/int4/float8 tensors are subclasses that compute their own products, and have no packed layout)."""
    return type(weight) in (torch.Tensor, nn.Parameter) and weight.dtype in dtypes


def pack_linears(model: nn.Module) -> int:
    """Turn every plain `nn.Linear` of `model` in a packable dtype into a `PackedLinear`, releasing the
    weights no other module holds; returns how many."""
    holders = Counter(p.data_ptr() for _, p in model.named_parameters(remove_duplicate=False))
    dtypes = packable_dtypes()
    count = 0
    for module in model.modules():
        if type(module) is not nn.Linear or not plain_weight(module.weight, dtypes):
            continue
        weight = module.weight
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
        module.__class__ = PackedLinear
        module.packed_weight = packed
        if holders[weight.data_ptr()] == 1:  # nobody else reads it: keep its shape, not its memory
            empty = torch.zeros((), dtype=weight.dtype, device=weight.device).expand(weight.shape)
            module.weight = nn.Parameter(empty, requires_grad=False)
        count += 1
    return count
