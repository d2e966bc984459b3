"""One forward step as two in-order streams: compute (the GPU's SMs) and communication (the NIC).

Each layer has, per micro-batch ``mb``, the compute stages ``A0`` (attention before core
attention), ``A1`` (core attention, output projection, MoE gate), ``S`` (shared expert) and ``M``
(routed experts, or a dense FFN), and the transfers ``D`` (dispatch, issued when ``A1`` ends) and
``C`` (combine, issued when ``M`` ends). Dependencies: ``A0(l)`` waits for ``C(l-1)`` and
``S(l-1)`` of its micro-batch, ``A1`` for ``A0``, ``S`` for ``A1``, ``M`` for ``D``. Compute runs in
the fixed order below; transfers run one at a time in the order they were issued.

Orders (shared/reference/kernel-apis.md, DeepSeek's published profiles), as one window per
layer ``l``, ``(stage, micro-batch, layer offset)``:

- prefill: ATTN(1) SHARED(0 of l-1) ATTN(0) MLP(1) MLP(0) SHARED(1), so that COMBINE(0),
  DISPATCH(1), DISPATCH(0), COMBINE(1) run under them;
- decode (attention in two stages): SHARED(0) ATTN-0(1) MLP(0) ATTN-1(1) SHARED(1) ATTN-0(0 of
  l+1) MLP(1) ATTN-1(0 of l+1);
- without overlap: one micro-batch, and compute waits for each transfer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Order = tuple[tuple[str, int, int], ...]

PREFILL_ORDER: Order = (
    ("A0", 1, 0),
    ("A1", 1, 0),
    ("S", 0, -1),
    ("A0", 0, 0),
    ("A1", 0, 0),
    ("M", 1, 0),
    ("M", 0, 0),
    ("S", 1, 0),
)
DECODE_ORDER: Order = (
    ("S", 0, 0),
    ("A0", 1, 0),
    ("M", 0, 0),
    ("A1", 1, 0),
    ("S", 1, 0),
    ("A0", 0, 1),
    ("M", 1, 0),
    ("A1", 0, 1),
)
SERIAL_ORDER: Order = (("A0", 0, 0), ("A1", 0, 0), ("S", 0, 0), ("M", 0, 0))


def step_time(stages: dict[str, np.ndarray | Sequence[float]], order: Order, serial: bool = False) -> float:
    """Time from the first stage to the last transfer of a step. ``stages`` maps A0, A1, S, M,
    D, C to per-layer durations (the same for every micro-batch); ``order`` names the micro-batches
    used (``SERIAL_ORDER``: one)."""
    dur = {name: np.asarray(stages[name], dtype=np.float64) for name in ("A0", "A1", "S", "M", "D", "C")}
    layers = len(dur["M"])
    end: dict[tuple[str, int, int], float] = {}
    compute_free = 0.0
    nic_free = 0.0

    def transfer(kind: str, mb: int, layer: int, issued: float) -> None:
        nonlocal nic_free, compute_free
        start = max(issued, nic_free)
        nic_free = end[(kind, mb, layer)] = start + dur[kind][layer]
        if serial:
            compute_free = max(compute_free, nic_free)

    def ready(stage: str, mb: int, layer: int) -> float:
        if stage == "A0":
            if layer == 0:
                return 0.0
            return max(end[("C", mb, layer - 1)], end[("S", mb, layer - 1)])
        if stage == "A1":
            return end[("A0", mb, layer)]
        if stage == "S":
            return end[("A1", mb, layer)]
        return end[("D", mb, layer)]  # M

    for window in range(-1, layers + 1):
        for stage, mb, offset in order:
            layer = window + offset
            if not 0 <= layer < layers or (stage, mb, layer) in end:
                continue
            start = max(compute_free, ready(stage, mb, layer))
            compute_free = end[(stage, mb, layer)] = start + dur[stage][layer]
            if stage == "A1":
                transfer("D", mb, layer, compute_free)
            elif stage == "M":
                transfer("C", mb, layer, compute_free)
    return max(end.values(), default=0.0)
