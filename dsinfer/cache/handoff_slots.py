"""Slots of registered memory that carry a sequence's bounded state from a prefill rank to a
decode rank beside its pages (DeepSeek-V4's resume point at the last whole page of a prompt).

One uint8 tensor ``[num_slots, 1, slot_bytes]``: a transfer library registers it as one more cache
layer and writes slot ``s`` of the prefill rank into slot ``d`` of the decode rank as it writes
pages. A slot is taken (``take``), filled and written on one side, reserved and read on the other,
and given back (``give``) once no write can still land in it.
"""

from __future__ import annotations

import torch


class HandoffSlots:
    def __init__(self, num_slots: int, slot_bytes: int, device: torch.device) -> None:
        if num_slots <= 0 or slot_bytes <= 0:
            raise ValueError(
                f"handoff slots need a positive count and size, got {num_slots} x {slot_bytes} B"
            )
        self.tensor = torch.zeros(num_slots, 1, slot_bytes, dtype=torch.uint8, device=device)
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def slot_bytes(self) -> int:
        return self.tensor.shape[2]

    def take(self) -> int | None:
        """A free slot, or None while every slot is held."""
        return self._free.pop() if self._free else None

    def give(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.tensor.shape[0]:
            raise ValueError(f"handoff slot {slot} is not held")
        self._free.append(slot)

    def write(self, slot: int, data: torch.Tensor) -> None:
        self.tensor[slot, 0].copy_(data)

    def read(self, slot: int) -> torch.Tensor:
        return self.tensor[slot, 0]

    @property
    def num_free(self) -> int:
        return len(self._free)
