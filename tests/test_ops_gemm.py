"""Block-FP8 quantization, the FP8 linear, grouped expert GEMMs and backend selection."""

from __future__ import annotations

import logging
import types

import pytest
import torch
import torch.nn.functional as F

from dsinfer.ops import Ops, select_ops
from dsinfer.ops import gemm as torch_gemm
from dsinfer.ops.amx_cpu import amx_bf16_available
from dsinfer.ops.external import DeepGemmAdapter, padded_rows
from dsinfer.ops.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_activation_1x128,
    dequantize_weight_128x128,
    fp8_gemm_nt,
    quantize_activation_1x128,
    quantize_weight_128x128,
)

# e4m3: 3 mantissa bits -> round-to-nearest relative error <= 2^-4 for normal values; below the
# smallest normal (2^-6) the spacing is 2^-9, so the absolute error is <= 2^-10 (in units of q).
REL = 2.0**-4
SUBNORMAL_ABS = 2.0**-10


@pytest.fixture
def ops() -> Ops:
    return select_ops(torch.device("cpu"), prefer="torch")


def _blocky(shape: tuple[int, ...], gen: torch.Generator, positive: bool = False) -> torch.Tensor:
    """Random values whose magnitude varies a lot from 128-block to 128-block."""
    x = torch.rand(shape, generator=gen) + 0.5 if positive else torch.randn(shape, generator=gen)
    mags = 10.0 ** torch.randint(-2, 3, (shape[0], -(-shape[1] // 128)), generator=gen).double()
    return (x.double() * mags.repeat_interleave(128, dim=1)[:, : shape[1]]).float()


def _elem_error_bound(x: torch.Tensor, block_scale_per_elem: torch.Tensor) -> torch.Tensor:
    return REL * x.abs().double() + SUBNORMAL_ABS * block_scale_per_elem.double() + 1e-12


@pytest.mark.parametrize("shape", [(5, 300), (1, 128), (3, 7)])
def test_quantize_activation_round_trip(shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(0)
    x = _blocky(shape, gen)
    q, s = quantize_activation_1x128(x)
    kb = -(-shape[1] // 128)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (shape[0], kb)
    for j in range(kb):
        block = x[:, j * 128 : (j + 1) * 128]
        torch.testing.assert_close(s[:, j], block.abs().amax(dim=1).clamp_min(1e-4) / FP8_MAX)
    assert q.float().abs().max() <= FP8_MAX
    s_elem = s.repeat_interleave(128, dim=1)[:, : shape[1]]
    err = (dequantize_activation_1x128(q, s).double() - x.double()).abs()
    assert (err <= _elem_error_bound(x, s_elem)).all()


@pytest.mark.parametrize("shape", [(200, 300), (128, 128), (5, 7)])
def test_quantize_weight_round_trip(shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(1)
    w = _blocky(shape, gen)
    q, s = quantize_weight_128x128(w)
    nb, kb = -(-shape[0] // 128), -(-shape[1] // 128)
    assert q.dtype == FP8_DTYPE and s.shape == (nb, kb)
    deq = dequantize_weight_128x128(q, s)
    for i in range(nb):
        for j in range(kb):
            rows, cols = slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128)
            block = w[rows, cols]
            torch.testing.assert_close(s[i, j], block.abs().max().clamp_min(1e-4) / FP8_MAX)
            # the documented formula W[i, j] = q[i, j] * s[i // 128, j // 128]
            torch.testing.assert_close(deq[rows, cols], q[rows, cols].float() * s[i, j])
            err = (deq[rows, cols].double() - block.double()).abs()
            assert (err <= REL * block.abs().double() + SUBNORMAL_ABS * s[i, j].double() + 1e-12).all()
    assert dequantize_weight_128x128(q, s, torch.bfloat16).dtype == torch.bfloat16


def test_zero_block_uses_minimum_amax() -> None:
    q, s = quantize_activation_1x128(torch.zeros(2, 130))
    torch.testing.assert_close(s, torch.full((2, 2), 1e-4 / FP8_MAX))
    assert (q.float() == 0).all()


def _fp8_linear_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Worst-case |y - x @ w^T| when ``w`` is exactly representable (a checkpoint's fp8 weight).

    Only the activation is rounded: |x' - x| <= ea elementwise, so the error is <= ea @ |w|^T,
    plus fp32 accumulation (2 k 2^-24 relative to |x| @ |w|^T, generous).
    """
    _, sa = quantize_activation_1x128(x)
    ea = _elem_error_bound(x, sa.repeat_interleave(128, 1)[:, : x.shape[1]])
    ax, aw = x.abs().double(), w.abs().double()
    return ea @ aw.t() + 2 * x.shape[1] * 2.0**-24 * (ax @ aw.t())


def test_fp8_linear_within_rounding_bound(ops: Ops) -> None:
    gen = torch.Generator().manual_seed(2)
    m, k, n = 6, 300, 200  # partial last blocks in k and n
    x = _blocky((m, k), gen, positive=True)
    w, w_s = quantize_weight_128x128(_blocky((n, k), gen, positive=True))
    w_exact = dequantize_weight_128x128(w, w_s).double()  # the checkpoint's weight, exactly
    y = ops.linear(x, w, w_s)
    assert y.shape == (m, n) and y.dtype == torch.float32
    exact = x.double() @ w_exact.t()
    bound = _fp8_linear_bound(x, w_exact)
    err = (y.double() - exact).abs()
    assert (err <= bound).all()
    # Not trivially loose: the bound is far below the output's scale (about 2^-4 of it)...
    assert (bound <= 0.07 * exact.abs()).all()
    # ...and a GEMM that misapplies one block scale by a few percent violates it.
    bad_s = w_s.clone()
    bad_s[1, 1] *= 1.1
    y_bad = ops.linear(x, w, bad_s)
    assert ((y_bad.double() - exact).abs() > bound).any()
    # The high-precision weight path is within the same bound of a float64 matmul.
    torch.testing.assert_close(ops.linear(x, w_exact.float()).double(), exact, rtol=1e-5, atol=0)


def test_fp8_linear_shapes_and_dtypes(ops: Ops) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 256, generator=gen)
    w, w_s = quantize_weight_128x128(torch.randn(64, 256, generator=gen))
    y = ops.linear(x, w, w_s)
    assert y.shape == (2, 3, 64)
    # identical to quantize -> reference fp8_gemm_nt on the flattened tokens
    q, s = quantize_activation_1x128(x.reshape(-1, 256))
    ref = fp8_gemm_nt(q, s, w, w_s, torch.empty(6, 64))
    torch.testing.assert_close(y.reshape(6, 64), ref)
    y16 = ops.linear(x.bfloat16(), w, w_s)
    assert y16.dtype == torch.bfloat16
    with pytest.raises(ValueError):
        ops.linear(x, w)
    assert ops.linear(torch.empty(0, 256), w, w_s).shape == (0, 64)


def test_high_precision_linear_is_f_linear(ops: Ops) -> None:
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(4, 5, 33, generator=gen), torch.randn(17, 33, generator=gen)
    torch.testing.assert_close(ops.linear(x, w), F.linear(x, w), rtol=0, atol=0)


@pytest.mark.parametrize("rows", [0, 1, 7, 64, 300])
def test_packed_bf16_linear_is_f_linear_bit_for_bit(ops: Ops, rows: int) -> None:
    """Where oneDNN has bf16 GEMMs the packed weight gives F.linear's bits; elsewhere the weight
    widened to float32 gives the float32 GEMM's, rounded once to bf16 (within bf16's rounding of
    ATen's own bf16 GEMM, which sums in another order)."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(576, 128, generator=gen).bfloat16()
    packed = ops.pack_linear_weight(w)
    assert packed is not None
    x = torch.randn(rows, 256, generator=gen).bfloat16()[:, ::2]  # strided, as a split's half is
    x3 = torch.randn(2, 3, 128, generator=gen).bfloat16()
    for a in (x, x3):
        if packed.dtype == torch.bfloat16:
            assert packed.is_mkldnn and torch.equal(ops.linear(a, packed), F.linear(a, w))
        else:  # 576 x 128 is below PACKED_F32_MIN_ELEMENTS: widened, not packed
            assert not packed.is_mkldnn and torch.equal(packed, w.float())
            assert torch.equal(ops.linear(a, packed), F.linear(a.float(), w.float()).bfloat16())
            torch.testing.assert_close(ops.linear(a, packed), F.linear(a, w), rtol=2**-7, atol=1e-2)


def test_pack_linear_weight_on_cpu_by_dtype_and_size(ops: Ops) -> None:
    """float32 weights from PACKED_F32_MIN_ELEMENTS on take oneDNN's layout; smaller ones, FP8
    and float64 keep their plain form (None)."""
    from dsinfer.ops.gemm import PACKED_F32_MIN_ELEMENTS

    assert ops.pack_linear_weight(torch.randn(8, 16)) is None
    assert ops.pack_linear_weight(torch.randn(256, 256)) is None
    assert ops.pack_linear_weight(torch.randn(512, 512, dtype=torch.float64)) is None
    fp8 = quantize_weight_128x128(torch.randn(128, 128))[0]
    assert ops.pack_linear_weight(fp8) is None
    packed = ops.pack_linear_weight(torch.randn(PACKED_F32_MIN_ELEMENTS // 256, 256))
    assert packed is not None and packed.is_mkldnn and packed.dtype == torch.float32


def test_packed_float32_linear_gives_each_row_the_same_bits_at_any_row_count(ops: Ops) -> None:
    """oneDNN's packed float32 GEMM: within float32 rounding of F.linear, and a row's output does
    not depend on how many rows share the call (MKL's does, below 6 rows), so a request's tokens
    do not depend on its batch."""
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(576, 256, generator=gen)
    packed = ops.pack_linear_weight(w)
    assert packed is not None
    x = torch.randn(300, 256, generator=gen)
    full = ops.linear(x, packed)
    torch.testing.assert_close(full, F.linear(x, w), rtol=1e-5, atol=1e-4)
    for rows in (1, 2, 3, 5, 16, 17, 64):
        assert torch.equal(ops.linear(x[:rows], packed), full[:rows]), rows
    assert torch.equal(ops.linear(x[:6].reshape(2, 3, 256), packed), full[:6].reshape(2, 3, 576))


def _grouped_weights(gen: torch.Generator, groups: int, n: int, k: int, fp8: bool):
    b_hp = torch.randn(groups, n, k, generator=gen)
    if not fp8:
        return b_hp, None, b_hp.double()
    qs = [quantize_weight_128x128(b_hp[g]) for g in range(groups)]
    b = torch.stack([q for q, _ in qs])
    b_s = torch.stack([s for _, s in qs])
    return b, b_s, torch.stack([dequantize_weight_128x128(q, s) for q, s in qs]).double()


def _as_gemm_sees(a: torch.Tensor, fp8: bool) -> torch.Tensor:
    if not fp8:
        return a.double()
    q, s = quantize_activation_1x128(a.reshape(-1, a.shape[-1]))
    return dequantize_activation_1x128(q, s).double().reshape(a.shape)


@pytest.mark.parametrize("fp8", [False, True])
def test_grouped_gemm_contiguous(ops: Ops, fp8: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    groups, n, k = 4, 136, 200
    b, b_s, b_ref = _grouped_weights(gen, groups, n, k, fp8)
    # group 1 is empty; padding rows (-1) between segments and at the end
    m_indices = torch.tensor([0, 0, 0, -1, 2, 2, 2, 2, 2, -1, -1, 3, -1], dtype=torch.int32)
    a = torch.randn(len(m_indices), k, generator=gen)
    a[m_indices < 0] = float("nan")  # padding rows may hold anything
    out = ops.grouped_gemm_contiguous(a, b, b_s, m_indices)
    assert out.shape == (len(m_indices), n) and out.dtype == a.dtype
    a_ref = _as_gemm_sees(torch.nan_to_num(a), fp8)
    ref = torch.zeros(len(m_indices), n, dtype=torch.float64)
    for g in range(groups):
        rows = (m_indices == g).nonzero().squeeze(1)
        if len(rows):
            ref[rows] = F.linear(a_ref[rows], b_ref[g])
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)
    assert (out[m_indices < 0] == 0).all()
    assert ops.grouped_gemm_contiguous(a[:0], b, b_s, m_indices[:0]).shape == (0, n)


@pytest.mark.parametrize("fp8", [False, True])
def test_grouped_gemm_masked(ops: Ops, fp8: bool) -> None:
    gen = torch.Generator().manual_seed(6)
    groups, m_max, n, k = 3, 4, 72, 260
    b, b_s, b_ref = _grouped_weights(gen, groups, n, k, fp8)
    masked_m = torch.tensor([0, 1, 4], dtype=torch.int32)
    a = torch.randn(groups, m_max, k, generator=gen)
    for g in range(groups):
        a[g, int(masked_m[g]) :] = float("nan")  # rows past masked_m are never read
    out = ops.grouped_gemm_masked(a, b, b_s, masked_m, expected_m=2)
    assert out.shape == (groups, m_max, n) and out.dtype == a.dtype
    a_ref = _as_gemm_sees(torch.nan_to_num(a), fp8)
    for g in range(groups):
        m = int(masked_m[g])
        torch.testing.assert_close(
            out[g, :m].double(), F.linear(a_ref[g, :m], b_ref[g]), rtol=1e-5, atol=1e-4
        )
        assert (out[g, m:] == 0).all()
    out_bf16 = ops.grouped_gemm_masked(a.bfloat16(), b, b_s, masked_m, 1)
    assert out_bf16.dtype == torch.bfloat16 and not out_bf16.isnan().any()


def test_select_ops_cpu_logs_one_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="dsinfer.ops"):
        ops = select_ops(torch.device("cpu"))
    lines = [r.getMessage() for r in caplog.records if r.name == "dsinfer.ops"]
    experts = "amx" if amx_bf16_available() else "numba"  # bf16 experts on AMX tiles where it has them
    assert lines == [
        f"ops backends: gemm=torch experts={experts} mla=numba indexer=torch sparse_mla=torch gate=numba "
        "v4_compress=torch mxfp4=torch sampling=torch norm=numba (device cpu)"
    ]
    assert not ops.supports_fp8_gemm
    assert dict(ops.backends) == {
        "gemm": "torch",
        "experts": experts,
        "mla": "numba",
        "indexer": "torch",
        "sparse_mla": "torch",
        "gate": "numba",
        "v4_compress": "torch",
        "mxfp4": "torch",
        "sampling": "torch",
        "norm": "numba",
    }
    assert ops.linear is torch_gemm.linear


def test_select_ops_prefer() -> None:
    assert select_ops("cpu", prefer="torch").backends["gemm"] == "torch"
    # a preferred backend that cannot run here falls back to the reference
    assert select_ops("cpu", prefer="deepgemm").backends["gemm"] == "torch"
    with pytest.raises(ValueError, match="unknown ops backend"):
        select_ops("cpu", prefer="cublas")


def _fake_deep_gemm(generation: str) -> types.ModuleType:
    """A stand-in exporting one DeepGEMM API generation, computing with the torch reference."""
    mod = types.ModuleType("fake_deep_gemm")

    def dense(a, b, out):
        fp8_gemm_nt(a[0], a[1], b[0], b[1], out)

    def contiguous(a, b, out, m_indices):
        for g in range(b[0].shape[0]):
            rows = (m_indices == g).nonzero().squeeze(1)
            tmp = torch.empty(len(rows), out.shape[1])
            fp8_gemm_nt(a[0][rows], a[1][rows], b[0][g], b[1][g], tmp)
            out[rows] = tmp.to(out.dtype)
        out[m_indices < 0] = 7.0  # garbage the adapter must clear

    def masked(a, b, out, masked_m, expected_m):
        for g in range(b[0].shape[0]):
            fp8_gemm_nt(a[0][g], a[1][g], b[0][g], b[1][g], out[g])

    names = (
        ("fp8_gemm_nt", "m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_masked")
        if generation == "new"
        else (
            "gemm_fp8_fp8_bf16_nt",
            "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous",
            "m_grouped_gemm_fp8_fp8_bf16_nt_masked",
        )
    )
    for name, fn in zip(names, (dense, contiguous, masked), strict=True):
        setattr(mod, name, fn)
    return mod


@pytest.mark.parametrize("generation", ["new", "old"])
def test_deepgemm_adapter_plumbing(ops: Ops, generation: str) -> None:
    adapter = DeepGemmAdapter(_fake_deep_gemm(generation))
    assert adapter.api == generation
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 256, generator=gen)
    w, w_s = quantize_weight_128x128(torch.randn(64, 256, generator=gen))
    torch.testing.assert_close(adapter.linear(x, w, w_s), ops.linear(x, w, w_s), rtol=1e-2, atol=1e-2)
    b, b_s, _ = _grouped_weights(gen, 2, 64, 256, fp8=True)
    m_indices = torch.tensor([0, 0, -1, 1], dtype=torch.int32)
    a = torch.randn(4, 256, generator=gen)
    torch.testing.assert_close(
        adapter.grouped_gemm_contiguous(a, b, b_s, m_indices),
        ops.grouped_gemm_contiguous(a, b, b_s, m_indices),
        rtol=1e-2,
        atol=1e-2,
    )
    with pytest.raises(ImportError):
        DeepGemmAdapter(types.ModuleType("empty"))


def _tile_storing_masked(block_m: int) -> types.ModuleType:
    """DeepGEMM's SM90 masked GEMM as it stores: whole ``block_m``-row tiles per group, rows past
    ``masked_m`` holding whatever the tile computed (here 8192), written through the flat
    ``[G * m, n]`` output with no ``m % block_m`` check. Groups run last to first, so a group's
    spilled tile lands on the next group's rows after those were written (one order the GPU may
    take)."""
    mod = _fake_deep_gemm("new")

    def masked(a, b, out, masked_m, expected_m):
        groups, m, n = out.shape
        flat = out.view(groups * m, n)
        for g in reversed(range(groups)):
            tile_rows = -(-int(masked_m[g]) // block_m) * block_m
            tile = torch.full((tile_rows, n), 8192.0)
            valid = int(masked_m[g])
            exact = torch.empty(valid, n)
            fp8_gemm_nt(a[0][g, :valid], a[1][g, :valid], b[0][g], b[1][g], exact)
            tile[:valid] = exact
            end = min(g * m + tile_rows, groups * m)
            flat[g * m : end] = tile[: end - g * m].to(out.dtype)

    mod.m_grouped_fp8_gemm_nt_masked = masked
    return mod


def test_padded_rows() -> None:
    assert [padded_rows(m, 128) for m in (1, 24, 128, 129)] == [128, 128, 128, 256]
    assert padded_rows(5, 1) == 5
    with pytest.raises(ValueError):
        padded_rows(5, 0)


def test_deepgemm_masked_pads_rows_to_whole_tiles(ops: Ops) -> None:
    """A decode bucket's capacity (here 5 rows per group) is not a multiple of DeepGEMM's tile: the
    adapter pads each group's rows so one group's last tile cannot overwrite the next group."""
    gen = torch.Generator().manual_seed(3)
    b, b_s, _ = _grouped_weights(gen, 3, 64, 256, fp8=True)
    a = torch.randn(3, 5, 256, generator=gen)
    masked_m = torch.tensor([5, 3, 4], dtype=torch.int32)
    expected = ops.grouped_gemm_masked(a, b, b_s, masked_m, 4)
    fake = _tile_storing_masked(block_m=64)
    got = DeepGemmAdapter(fake, m_alignment=128).grouped_gemm_masked(a, b, b_s, masked_m, 4)
    assert got.shape == (3, 5, 64)
    for g, rows in enumerate(masked_m.tolist()):
        torch.testing.assert_close(got[g, :rows], expected[g, :rows], rtol=1e-2, atol=1e-2)
    # without the padding the emulated kernel's spilled tiles overwrite the next group's rows
    unpadded = DeepGemmAdapter(fake, m_alignment=1).grouped_gemm_masked(a, b, b_s, masked_m, 4)
    assert (unpadded[1, :3] == 8192.0).all()


def test_the_widened_weight_pays_from_its_row_threshold() -> None:
    """Where the CPU has no bf16 GEMMs, a bf16 linear takes the float32 copy from WIDENED_MIN_ROWS
    rows on (a GEMV reads half the bytes from the bf16 weight); a form of the input's dtype always."""
    from dsinfer.ops import packed_pays
    from dsinfer.ops.gemm import WIDENED_MIN_ROWS

    widened = torch.randn(8, 32).bfloat16().float()
    assert not packed_pays(torch.zeros(WIDENED_MIN_ROWS - 1, 32, dtype=torch.bfloat16), widened)
    assert packed_pays(torch.zeros(WIDENED_MIN_ROWS, 32, dtype=torch.bfloat16), widened)
    assert packed_pays(torch.zeros(2, WIDENED_MIN_ROWS // 2, 32, dtype=torch.bfloat16), widened)
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        packed = torch.ops.mkldnn._reorder_linear_weight(widened.bfloat16(), None)
        assert packed_pays(torch.zeros(1, 32, dtype=torch.bfloat16), packed)
    packed_f32 = torch.ops.mkldnn._reorder_linear_weight(torch.randn(8, 32), None)
    assert packed_pays(torch.zeros(1, 32), packed_f32)
