"""DeepSeek-V3's MoE gate for CPUs (numba): the reference's dozen ATen operations
(:func:`dsinfer.ops.gate.moe_gate`) in one call, about 65 us a decode step's layer in torch.

One token at a time: sigmoid scores, the bias added for the choice only, the group limit (a
group's score is the sum of its two best choice scores; groups outside the ``topk_group`` best
are out), then the ``top_k`` best choice scores in descending order (ties to the lower index),
weighted by the unbiased scores, normalised and scaled in float32 as the reference does.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from dsinfer.ops import gate as torch_gate
from dsinfer.ops.compile_ahead import c_array

__all__ = ["compile_ahead", "moe_gate"]


@numba.njit(cache=True)
def _best(values, taken):
    """Index of the largest value not taken (the lower index on ties); -1 when none is left."""
    best, where = -np.inf, -1
    for i in range(values.shape[0]):
        if not taken[i] and (where < 0 or values[i] > best):
            best, where = values[i], i
    return where


@numba.njit(cache=True)
def _gate(logits, bias, top_k, n_group, topk_group, norm, scale, weights, ids):
    tokens, experts = logits.shape
    per_group = experts // n_group
    limited = n_group > 1 and topk_group < n_group
    scores = np.empty(experts, dtype=np.float32)
    choice = np.empty(experts, dtype=np.float32)
    group_score = np.empty(n_group, dtype=np.float32)
    group_kept = np.zeros(n_group, dtype=np.bool_)
    taken = np.zeros(experts, dtype=np.bool_)
    for t in range(tokens):
        for e in range(experts):
            s = np.float32(1.0) / (np.float32(1.0) + np.exp(-logits[t, e]))
            scores[e] = s
            choice[e] = s + bias[e] if bias.shape[0] > 0 else s
        taken[:] = False
        if limited:
            for g in range(n_group):
                first, second = -np.inf, -np.inf
                for e in range(g * per_group, (g + 1) * per_group):
                    if choice[e] > first:
                        first, second = choice[e], first
                    elif choice[e] > second:
                        second = choice[e]
                group_score[g] = first + second if per_group > 1 else first
            group_kept[:] = False
            for _ in range(topk_group):
                group_kept[_best(group_score, group_kept)] = True
            for e in range(experts):
                taken[e] = not group_kept[e // per_group]  # outside the kept groups: never picked
        total = np.float32(0.0)
        for r in range(top_k):
            e = _best(choice, taken)
            taken[e] = True
            ids[t, r] = e
            weights[t, r] = scores[e]
            total += scores[e]
        for r in range(top_k):
            w = weights[t, r] / (total + np.float32(1e-20)) if norm else weights[t, r]
            weights[t, r] = w * np.float32(scale)


_GATE_SIGNATURE = (
    c_array(numba.float32, 2),  # router logits
    c_array(numba.float32, 1),  # bias (empty: none)
    numba.int64,  # top_k
    numba.int64,  # n_group
    numba.int64,  # topk_group
    numba.boolean,  # norm_topk_prob
    numba.float64,  # routed_scaling_factor
    c_array(numba.float32, 2),  # weights
    c_array(numba.int64, 2),  # ids
)
_NO_BIAS = np.empty(0, dtype=np.float32)


def compile_ahead() -> None:
    """Compile (or load from numba's cache) the kernel for the signature every call uses."""
    _gate.compile(_GATE_SIGNATURE)


def moe_gate(
    router_logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``MoeGate`` contract (dsinfer/ops/signatures.py; its reference: dsinfer.ops.gate.moe_gate)."""
    if not router_logits.is_cpu:
        return torch_gate.moe_gate(
            router_logits, bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor
        )
    num_tokens, num_experts = router_logits.shape
    torch_gate.check_gate(num_experts, top_k, n_group, topk_group)
    logits = router_logits.detach().float().contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64)
    if num_tokens:
        bias_np = _NO_BIAS if bias is None else bias.detach().float().contiguous().numpy()
        _gate(
            logits.numpy(),
            bias_np,
            top_k,
            n_group,
            topk_group,
            norm_topk_prob,
            float(routed_scaling_factor),
            weights.numpy(),
            ids.numpy(),
        )
    return weights, ids
