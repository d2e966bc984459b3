"""Building blocks: RMSNorm, LayerNorm, the linear layer that routes every GEMM through ops, YaRN RoPE, the MLP."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dsinfer.base.config import FP8_BLOCK, RopeConfig
from dsinfer.ops import Ops, packed_pays


class RMSNorm(nn.Module):
    """Through ``ops.rms_norm``: normalised in fp32, then rounded to ``x``'s dtype before the
    weight multiplies it (as transformers' DeepseekV3RMSNorm)."""

    def __init__(self, dim: int, ops: Ops, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps, self.ops = eps, ops
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias, computed in fp32 (V3.2's indexer key norm)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), self.eps)
        return y.to(x.dtype)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class Linear(nn.Module):
    """y = x W^T through ``ops.linear``: the single GEMM dispatch point of the model.

    The weight is high precision, or FP8 e4m3 with ``weight_scale_inv`` holding one fp32 scale per
    128x128 block (DeepSeek's checkpoint format); which one is decided by the loader. After loading,
    ``pack`` may add ``packed``: the weight in the form ``ops.linear`` runs fastest (a second copy;
    used for activations of the weight's dtype, ``weight`` for the others).
    """

    def __init__(self, in_features: int, out_features: int, ops: Ops, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.ops = in_features, out_features, ops
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight_scale_inv: nn.Parameter | None = None
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None
        self.stacked_into = False  # its rows live in a stack's weight (Linear.stack): not run, not packed

    def pack(self) -> None:
        """Derive ``packed`` from the loaded high-precision weight, where the backend has a form."""
        if self.weight_scale_inv is None and not self.stacked_into:
            self.packed = self.ops.pack_linear_weight(self.weight)

    @classmethod
    def stack(cls, parts: list[Linear]) -> Linear | None:
        """One Linear whose output rows are ``parts``' in order, for inputs they share: one GEMM
        instead of several. Each part's weight, scales and bias become views of the stack's (no
        second copy) and it is marked ``stacked_into`` (not packed; callers run the stack). None
        where they cannot stack: other inputs or storage, or FP8 scale blocks that would straddle
        two parts (every part but the last needs a multiple of 128 rows)."""
        first = parts[0]
        fp8 = first.weight_scale_inv is not None
        if any(
            p.in_features != first.in_features
            or p.weight.dtype != first.weight.dtype
            or (p.weight_scale_inv is not None) != fp8
            or (p.bias is not None) != (first.bias is not None)
            for p in parts
        ):
            return None
        if fp8 and any(p.out_features % FP8_BLOCK for p in parts[:-1]):
            return None
        stacked = cls(
            first.in_features, sum(p.out_features for p in parts), first.ops, first.bias is not None
        )
        stacked.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
        if fp8:
            scales = torch.cat([p.weight_scale_inv for p in parts])  # type: ignore[misc]
            stacked.weight_scale_inv = nn.Parameter(scales, requires_grad=False)
        if first.bias is not None:
            stacked.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)  # type: ignore[misc]
        row = 0
        for p in parts:
            rows = slice(row, row + p.out_features)
            p.weight = nn.Parameter(stacked.weight[rows], requires_grad=False)
            if fp8:
                assert stacked.weight_scale_inv is not None
                blocks = slice(row // FP8_BLOCK, (row + p.out_features + FP8_BLOCK - 1) // FP8_BLOCK)
                p.weight_scale_inv = nn.Parameter(stacked.weight_scale_inv[blocks], requires_grad=False)
            if p.bias is not None:
                assert stacked.bias is not None
                p.bias = nn.Parameter(stacked.bias[rows], requires_grad=False)
            p.stacked_into = True
            row += p.out_features
        return stacked

    def make_fp8(self) -> None:
        """Switch to FP8 storage (called by the loader before copying an FP8 checkpoint in)."""
        device = self.weight.device
        self.weight = nn.Parameter(
            torch.empty(self.out_features, self.in_features, dtype=torch.float8_e4m3fn, device=device),
            requires_grad=False,
        )
        scale_shape = (math.ceil(self.out_features / FP8_BLOCK), math.ceil(self.in_features / FP8_BLOCK))
        self.weight_scale_inv = nn.Parameter(torch.empty(scale_shape, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed is not None and x.dtype == self.weight.dtype and packed_pays(x, self.packed)
        y = self.ops.linear(x, self.packed if packed else self.weight, self.weight_scale_inv)
        return y + self.bias if self.bias is not None else y

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in high precision (dequantized if FP8)."""
        if self.weight_scale_inv is None:
            return self.weight.to(dtype)
        scale = self.weight_scale_inv.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
        scale = scale[: self.out_features, : self.in_features]
        return (self.weight.float() * scale).to(dtype)

    def extra_repr(self) -> str:
        fp8 = ", fp8" if self.weight_scale_inv is not None else ""
        return f"in={self.in_features}, out={self.out_features}{fp8}"


class MLP(nn.Module):
    """SwiGLU feed-forward: the dense layers' MLP and the shared experts."""

    def __init__(self, hidden: int, intermediate: int, ops: Ops) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, ops)
        self.up_proj = Linear(hidden, intermediate, ops)
        self.down_proj = Linear(intermediate, hidden, ops)
        self.gate_up: Linear | None = None  # gate_proj and up_proj stacked, set by stack_gate_up()

    def stack_gate_up(self) -> None:
        """After loading: gate_proj and up_proj read the same input, so run them as one GEMM of
        their stacked rows (a decode step's small GEMMs cost their call more than their work)."""
        if self.gate_up is None:
            self.gate_up = Linear.stack([self.gate_proj, self.up_proj])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def yarn_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """Per-pair rotation frequencies [dim/2]; YaRN blends interpolated and extrapolated ones."""
    wavelengths = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    extrapolated = 1.0 / wavelengths
    if rope.type != "yarn":
        return extrapolated
    interpolated = 1.0 / (rope.factor * wavelengths)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    return interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight


class RotaryEmbedding(nn.Module):
    """RoPE over the last ``dim`` channels, on interleaved pairs (DeepSeek) or on halves."""

    def __init__(self, rope: RopeConfig, dim: int, interleaved: bool) -> None:
        super().__init__()
        self.interleaved = interleaved
        self.attention_factor = rope.attention_factor
        self.register_buffer("inv_freq", yarn_inv_freq(rope, dim).to("cpu"), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the positions, YaRN's attention factor applied: [T, dim/2], one per pair;
        interleaved, [T, dim]: each pair's cos twice and its sin as (-sin, +sin), so that ``forward``
        is two products and a sum, bit for bit the rotation written out pair by pair."""
        angles = positions.float()[:, None] * self.inv_freq
        cos, sin = angles.cos() * self.attention_factor, angles.sin() * self.attention_factor
        if self.interleaved:
            cos, sin = cos.repeat_interleave(2, dim=-1), torch.stack((-sin, sin), dim=-1).flatten(-2)
        return cos.to(dtype), sin.to(dtype)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [T, ..., dim] rotated by ``cos_sin(positions)``."""
        cos, sin = cos_sin
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
        cos, sin = cos.view(shape), sin.view(shape)
        if self.interleaved:  # pair (a, b) -> (a cos - b sin, b cos + a sin)
            return x * cos + x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2) * sin
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
