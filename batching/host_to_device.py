"""Small host lists to device tensors without making the host wait for the device.

`torch.tensor(values, device="cuda")` copies from pageable memory and then synchronizes the stream: the
host waits for every kernel queued before it. With async scheduling (engine.py) the host builds the next
step while the device runs this one, so every list a step sends goes through pinned memory in a copy the
stream orders, and the host goes on at once (torch's pinned-memory cache keeps the buffer until the copy
has run). On the CPU it is `torch.tensor`.
"""

from __future__ import annotations

import torch


def device_tensor(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
