"""Routed experts on AMX tiles (bf16): against the float64 reference, a row's bits whatever the
batch, and the parts that run on any CPU (the fallback, the vectorizable exp, the tile
configuration, the engine's choice of backend)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from dsinfer.engine.args import EngineArgs
from dsinfer.engine.engine import LLMEngine
from dsinfer.ops import experts_amx, experts_cpu
from dsinfer.ops.amx_cpu import amx_bf16_available, tile_config
from dsinfer.ops.experts_amx import fused_experts

needs_amx = pytest.mark.skipif(not amx_bf16_available(), reason="needs a CPU with AMX bf16 tiles")


def _reference(rows: torch.Tensor, slots: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    inter = w13.shape[1] // 2
    r, a, b = rows.double(), w13.double(), w2.double()
    return torch.stack(
        [
            (F.silu(r[i] @ a[s, :inter].t()) * (r[i] @ a[s, inter:].t())) @ b[s].t()
            for i, s in enumerate(slots.tolist())
        ]
    )


def _case(m: int, slots_n: int, hidden: int, inter: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(m, hidden, generator=g).bfloat16()
    slots = torch.randint(slots_n, (m,), generator=g)
    w13 = (torch.randn(slots_n, 2 * inter, hidden, generator=g) * hidden**-0.5).bfloat16()
    w2 = (torch.randn(slots_n, hidden, inter, generator=g) * inter**-0.5).bfloat16()
    return rows, slots, w13, w2


@needs_amx
@pytest.mark.parametrize(
    ("m", "slots_n", "hidden", "inter"),
    [(1, 2, 64, 32), (40, 2, 128, 64), (300, 8, 256, 128), (70, 3, 1024, 512)],  # up to 5 blocks of 16 rows
)
def test_amx_experts_match_the_reference(m: int, slots_n: int, hidden: int, inter: int) -> None:
    rows, slots, w13, w2 = _case(m, slots_n, hidden, inter)
    assert experts_amx.fits(hidden, inter)
    out = fused_experts(rows, slots, w13, None, w2, None)
    assert out.dtype == torch.bfloat16 and out.shape == (m, hidden)
    expected = _reference(rows, slots, w13, w2)
    # bf16 output and the SwiGLU rounded to bf16 once (the reference stays float64)
    assert torch.allclose(out.double(), expected, atol=2e-2, rtol=2e-2)
    direct = torch.empty(m, hidden)
    experts_amx.experts_amx(
        rows.view(torch.int32).numpy().view(np.uint32),
        slots.numpy(),
        w13.view(torch.int16).numpy().view(np.uint16),
        w2.view(torch.int16).numpy().view(np.uint16),
        direct.numpy(),
    )
    assert torch.equal(direct.bfloat16(), out)  # fused_experts took the AMX kernel


@needs_amx
def test_amx_experts_row_result_does_not_depend_on_the_batch() -> None:
    rows, slots, w13, w2 = _case(90, 3, 128, 64, seed=3)
    whole = fused_experts(rows, slots, w13, None, w2, None)
    for i in (0, 17, 89):
        assert torch.equal(fused_experts(rows[i : i + 1], slots[i : i + 1], w13, None, w2, None)[0], whole[i])
    assert torch.equal(fused_experts(rows[::3], slots[::3], w13, None, w2, None), whole[::3])


def test_shapes_that_do_not_fill_tiles_stay_on_the_float32_kernel() -> None:
    assert experts_amx.fits(256, 128) and experts_amx.fits(7168, 2048)
    assert not experts_amx.fits(30, 6) and not experts_amx.fits(96, 64) and not experts_amx.fits(128, 48)
    g = torch.Generator().manual_seed(1)
    rows, slots = torch.randn(5, 96, generator=g).bfloat16(), torch.tensor([0, 1, 0, 1, 1])
    w13, w2 = torch.randn(2, 128, 96, generator=g).bfloat16(), torch.randn(2, 96, 64, generator=g).bfloat16()
    expected = experts_cpu.fused_experts(rows, slots, w13, None, w2, None)
    assert torch.equal(fused_experts(rows, slots, w13, None, w2, None), expected)
    f32 = [t.float() for t in (rows, w13, w2)]  # float32 rows: the float32 kernel, whatever the sizes
    assert torch.equal(
        experts_amx.fused_experts(f32[0], slots, f32[1], None, f32[2], None),
        experts_cpu.fused_experts(f32[0], slots, f32[1], None, f32[2], None),
    )


def test_tile_config_rejects_what_a_tile_cannot_hold() -> None:
    config = tile_config({0: (16, 64), 3: (4, 16)})
    assert config[0] == 1 and config[16:48].view(np.uint16)[3] == 16 and config[48 + 3] == 4
    with pytest.raises(ValueError, match="not a tile"):
        tile_config({0: (17, 64)})
    with pytest.raises(ValueError, match="not a tile"):
        tile_config({8: (16, 64)})


def test_the_engine_takes_its_kernel_backends_from_its_arguments() -> None:
    auto = LLMEngine(EngineArgs(dtype="bfloat16", kv_cache_memory="16MiB"))
    assert auto.ops.backends["experts"] == ("amx" if amx_bf16_available() else "numba")
    numba_only = LLMEngine(EngineArgs(dtype="bfloat16", kv_cache_memory="16MiB", kernel_backends="numba"))
    assert numba_only.ops.backends["experts"] == "numba"
    with pytest.raises(ValidationError, match="unknown ops backend 'amx2'; choose from"):
        EngineArgs(kernel_backends="numba,amx2")
