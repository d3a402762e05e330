"""The recurrent and convolution state of a model's non-attention layers, one fixed-size slot per sequence.

Mamba and Mamba-2 mixers, gated delta nets, short convolutions and their kin keep no per-token KV:
what a sequence has seen is a fixed-size state per layer (a convolution window and a recurrent
state, sometimes several of each). genq keeps it beside the paged KV cache, in slots: slot `s` of
every state tensor is one sequence's state. The block manager hands out slot ids (torch-free, as
it does block ids): a running sequence holds one device slot, a swapped-out one a host slot.

device: per state, [num_slots, *shape] (shape: what transformers' own cache layer holds for a
        batch of one, without its batch axis)
host:   the same, [num_host_slots, *shape] (pinned on CUDA), where a swap-out copies a slot and a
        swap-in copies it back, in the step that the KV blocks move.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class StateSpec:
    """One state tensor of one layer: which layer, conv or recurrent, which of the layer's states."""

    layer: int
    kind: str  # "conv" | "recurrent"
    index: int  # transformers' state_idx
    shape: tuple[int, ...]  # one sequence's
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(slots=True)
class StateGeometry:
    """What the model's state layers keep per sequence (found by the load-time shape forward)."""

    specs: list[StateSpec]
    states_per_layer: dict[int, int]  # layer -> how many states transformers' cache layer holds

    @property
    def bytes_per_slot(self) -> int:
        return sum(s.nbytes for s in self.specs)


class StateCache:
    def __init__(self, geometry: StateGeometry, num_slots: int, num_host_slots: int, device: torch.device):
        self.geometry = geometry
        self.device = device
        pin = device.type == "cuda"
        self.device_states: dict[tuple[int, str, int], torch.Tensor] = {}
        self.host_states: dict[tuple[int, str, int], torch.Tensor] = {}
        for spec in geometry.specs:
            key = (spec.layer, spec.kind, spec.index)
            self.device_states[key] = torch.zeros((num_slots, *spec.shape), dtype=spec.dtype, device=device)
            self.host_states[key] = torch.zeros(
                (num_host_slots, *spec.shape), dtype=spec.dtype, pin_memory=pin
            )

    def spec(self, layer: int, kind: str, index: int) -> StateSpec | None:
        for s in self.geometry.specs:
            if (s.layer, s.kind, s.index) == (layer, kind, index):
                return s
        return None

    def gather(self, layer: int, kind: str, index: int, slots: torch.Tensor) -> torch.Tensor | None:
        """[n, *shape]: the states of `slots` (a copy), or None if the layer keeps no such state."""
        states = self.device_states.get((layer, kind, index))
        return None if states is None else states.index_select(0, slots)

    def scatter(self, layer: int, kind: str, index: int, slots: torch.Tensor, values: torch.Tensor) -> None:
        """Write `values` [n, *shape] into `slots`."""
        states = self.device_states.get((layer, kind, index))
        if states is None or tuple(values.shape[1:]) != tuple(states.shape[1:]):
            got = None if states is None else tuple(states.shape[1:])
            raise RuntimeError(
                f"layer {layer}'s {kind} state {index} came out as {tuple(values.shape[1:])}, where the "
                f"load-time forward found {got}: its state is not of a fixed size"
            )
        states.index_copy_(0, slots, values.to(states.dtype))

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Copy device slots to host slots (swap_out: [(slot, host slot)]), then host slots to device
        slots (swap_in: [(host slot, slot)]), on the compute stream, before the step's forward."""
        if not swap_out and not swap_in:
            return
        for key, states in self.device_states.items():
            host = self.host_states[key]
            if swap_out:
                src = torch.tensor([d for d, _ in swap_out], device=self.device)
                host[torch.tensor([h for _, h in swap_out])] = states.index_select(0, src).cpu()
            if swap_in:
                dst = torch.tensor([d for _, d in swap_in], device=self.device)
                values = host[torch.tensor([h for h, _ in swap_in])].to(self.device)
                states.index_copy_(0, dst, values)
