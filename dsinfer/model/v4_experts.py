"""Where online EPLB reads a DeepSeek-V4 pool's routed experts from: the checkpoint the model was
loaded from, expert by expert, as ``load_v4`` puts them in a slot (dequantised into the model's
dtype, or the MXFP4 bytes and scales kept packed), or the slot of this rank that holds one now.

``stage`` plans new expert tensors for the MoE layers whose slots change; each piece of the
staging fills one slot (V3's staging, dsinfer/model/expert_staging.py, cuts finer: its experts
are wider); the balancer runs pieces at step boundaries under its budget and swaps the tensors in
(``V4MoE.install``).
"""

from __future__ import annotations

from collections import deque
from contextlib import ExitStack
from pathlib import Path

import torch

from dsinfer.model.v4_loader import V4Checkpoint, read_expert
from dsinfer.model.v4_moe import V4MoE

Staged = tuple[list[int], dict[str, torch.Tensor]]  # a MoE layer's slots' experts and tensors


class V4ExpertSource:
    def __init__(self, path: str | Path, num_mtp_layers: int = 0) -> None:
        self._stack = ExitStack()
        self.checkpoint = V4Checkpoint(Path(path), self._stack, num_mtp_layers)

    def stage(self, wanted: dict[str, list[int]], held: dict[str, V4MoE]) -> V4ExpertStaging:
        """New tensors for the MoE layers ``wanted`` names (their module name in the served model
        -> the experts of their slots), ``held`` every layer's current module."""
        return V4ExpertStaging(self.checkpoint, wanted, held)

    def close(self) -> None:
        self._stack.close()


class V4ExpertStaging:
    def __init__(
        self, checkpoint: V4Checkpoint, wanted: dict[str, list[int]], held: dict[str, V4MoE]
    ) -> None:
        self.checkpoint, self.held = checkpoint, held
        self.modules: dict[str, Staged] = {}
        self._pieces: deque[tuple[str, int, int]] = deque()
        for name, experts in wanted.items():
            moe = held[name]
            tensors = {}
            for t in moe.expert_tensor_names:
                now = getattr(moe, t)
                tensors[t] = torch.empty((len(experts), *now.shape[1:]), dtype=now.dtype, device=now.device)
            self.modules[name] = (list(experts), tensors)
            self._pieces.extend((name, slot, expert) for slot, expert in enumerate(experts))
        self.total = len(self._pieces)

    @property
    def pieces_left(self) -> int:
        return len(self._pieces)

    def fill_next(self) -> bool:
        """Fill one slot; whether pieces are left."""
        name, slot, expert = self._pieces.popleft()
        moe, (_, tensors) = self.held[name], self.modules[name]
        if expert in moe.local_experts:
            held = moe.local_experts.index(expert)
            for t, target in tensors.items():
                target[slot].copy_(getattr(moe, t)[held])
        else:
            dtype = None if moe.mxfp4 else moe.w13.dtype
            prefix = name.removeprefix("model.")  # the served model's module -> the checkpoint's name
            for t, tensor in read_expert(self.checkpoint, prefix, expert, dtype).items():
                tensors[t][slot].copy_(tensor)
        return bool(self._pieces)
