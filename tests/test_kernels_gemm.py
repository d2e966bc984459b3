"""Triton block-FP8 kernels of dsinfer.kernels against the torch references of dsinfer.ops, on CPU.

The kernels run under ``TRITON_INTERPRET=1``, which must be set before triton is imported; other
test modules of this pytest process may already have imported it without. So the checks run in a
fresh interpreter (``python -m tests.test_kernels_gemm``, the ``__main__`` block below) that prints
one JSON object, check name -> "ok" or the failure, and each pytest test asserts one entry. Every
check also counts the launches of the jitted kernels, so a torch fallback cannot pass for them.

Tolerance of a GEMM (derived, not tuned): the exact product of the quantized operands is ``P``; the
kernel and the reference each sum in fp32, in a different order, so each is within
``k * 2^-24 * (|A| @ |B|^T)`` of ``P``; a bf16 output adds at most one bf16 spacing, ``2^-7 |P|``
(truncation in the interpreter, round-to-nearest, half that, on a GPU).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[1]
GEN_SEED = 1234


# ----------------------------------------------------------------------------- helpers (subprocess)


@contextlib.contextmanager
def launches(kernel: Any) -> Iterator[list[int]]:
    """Count launches of a jitted kernel (``kernel[grid](...)`` calls ``kernel.run``)."""
    calls: list[int] = []
    original = kernel.run

    def run(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    with mock.patch.object(kernel, "run", run):
        yield calls


def _expect(cond: bool, message: str) -> None:
    if not cond:
        raise AssertionError(message)


def _weights(gen: torch.Generator, groups: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    from dsinfer.ops.fp8 import quantize_weight_128x128

    pairs = [quantize_weight_128x128(torch.randn(n, k, generator=gen)) for _ in range(groups)]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def _activations(gen: torch.Generator, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    from dsinfer.ops.fp8 import quantize_activation_1x128

    return quantize_activation_1x128(torch.randn(*shape, generator=gen) * 3)


def _abs_product(qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    from dsinfer.ops.fp8 import dequantize_activation_1x128, dequantize_weight_128x128

    return dequantize_activation_1x128(qa, sa).abs() @ dequantize_weight_128x128(qb, sb).abs().t()


def _assert_gemm_close(
    out: torch.Tensor,
    ref: torch.Tensor,
    abs_product: torch.Tensor,
    k: int,
    what: str,
    via_bf16: bool | None = None,
) -> None:
    """``out`` against the fp32 reference ``ref`` within the bound of the module docstring."""
    if out.numel() == 0:
        return
    out32 = out.float()
    tol = 2 * k * 2.0**-24 * abs_product + 1e-30
    if via_bf16 or (via_bf16 is None and out.dtype == torch.bfloat16):
        tol = tol + 2.0**-7 * ref.abs()
    err = (out32 - ref).abs()
    _expect(bool(torch.isfinite(out32).all()), f"{what}: non-finite output")
    worst = int((err / tol).flatten().argmax())
    _expect(
        bool((err <= tol).all()),
        f"{what}: error {err.flatten()[worst]:.3e} exceeds bound {tol.flatten()[worst]:.3e} "
        f"(ref {ref.flatten()[worst]:.4e})",
    )


def _reference_rows(
    qa: torch.Tensor, sa: torch.Tensor, qb: torch.Tensor, sb: torch.Tensor, groups: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 reference and ``|A|@|B|^T`` of every row ``i`` through expert ``groups[i]`` (-1 rows: 0)."""
    from dsinfer.ops.fp8 import fp8_gemm_nt

    ref = torch.zeros(qa.shape[0], n)
    bound = torch.zeros(qa.shape[0], n)
    for e in sorted(set(groups.tolist()) - {-1}):
        rows = (groups == e).nonzero().flatten()
        part = torch.empty(rows.numel(), n)
        fp8_gemm_nt(qa[rows], sa[rows], qb[e], sb[e], part)
        ref[rows] = part
        bound[rows] = _abs_product(qa[rows], sa[rows], qb[e], sb[e])
    return ref, bound


# ----------------------------------------------------------------------------- checks (subprocess)


def check_quantize_matches_reference() -> None:
    """Bit-identical fp8 values and scales: ragged k, one token, 3-D, bf16 input, zero block, ties."""
    from dsinfer.kernels import fp8_gemm as kmod

    from dsinfer.ops.fp8 import FP8_DTYPE, quantize_activation_1x128

    gen = torch.Generator().manual_seed(GEN_SEED)
    cases = [
        torch.randn(1, 128, generator=gen),
        torch.randn(5, 200, generator=gen) * 40,
        torch.randn(33, 384, generator=gen) * 1e-3,
        torch.randn(2, 3, 256, generator=gen).to(torch.bfloat16),
    ]
    zero_block = torch.randn(4, 256, generator=gen)
    zero_block[1, :128] = 0.0  # amax clamped to 1e-4
    cases.append(zero_block)
    # Midpoints between neighbouring e4m3 values (and the values themselves) with scale exactly 1:
    # the rounding must be to nearest, ties to even, subnormals included.
    grid = torch.arange(0, 127, dtype=torch.uint8).view(FP8_DTYPE).float()
    mids = torch.cat([grid, (grid[1:] + grid[:-1]) / 2])
    mids = torch.cat([mids, -mids])
    blocks = mids.split(127)
    cases.append(
        torch.cat([torch.cat([torch.tensor([448.0]), b, b.new_zeros(127 - b.numel())]) for b in blocks])[None]
    )
    for x in cases:
        with launches(kmod._quantize_1x128_kernel) as calls:
            q, s = kmod.quantize_activation_1x128(x)
        q_ref, s_ref = quantize_activation_1x128(x)
        what = f"x {tuple(x.shape)} {x.dtype}"
        _expect(len(calls) == 1, f"{what}: {len(calls)} launches")
        _expect(q.dtype == FP8_DTYPE and q.shape == x.shape and s.shape == s_ref.shape, f"{what}: shapes")
        _expect(torch.equal(s, s_ref), f"{what}: scales differ, max {(s - s_ref).abs().max():.3e}")
        diff = (q.view(torch.uint8) != q_ref.view(torch.uint8)).nonzero()
        _expect(diff.numel() == 0, f"{what}: {diff.shape[0]} fp8 values differ, first at {diff[:1].tolist()}")


def check_dense_gemm() -> None:
    """One token, ragged m, n and k not multiples of 128, n < 128, MN-major activation scales."""
    from dsinfer.kernels import fp8_gemm as kmod

    from dsinfer.ops.fp8 import fp8_gemm_nt

    gen = torch.Generator().manual_seed(GEN_SEED + 1)
    for m, n, k, mn_major in [
        (1, 128, 128, False),
        (37, 192, 320, True),
        (70, 256, 256, False),
        (3, 40, 200, True),
    ]:
        qa, sa = _activations(gen, m, k)
        if mn_major:  # DeepGEMM's activation-scale layout: same values, column-major strides
            sa = sa.t().contiguous().t()
        qb, sb = (t[0] for t in _weights(gen, 1, n, k))
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
        with launches(kmod._fp8_gemm_nt_kernel) as calls:
            kmod.fp8_gemm_nt((qa, sa), (qb, sb), out)
        ref = fp8_gemm_nt(qa, sa, qb, sb, torch.empty(m, n))
        _expect(len(calls) == 1, f"dense {m}x{n}x{k}: {len(calls)} launches")
        _assert_gemm_close(out, ref, _abs_product(qa, sa, qb, sb), k, f"dense {m}x{n}x{k}")


def check_dense_gemm_fp32_and_accumulate() -> None:
    """fp32 output; ``c`` added (separate tensor and in place), as DeepGEMM's accumulating form."""
    from dsinfer.kernels import fp8_gemm as kmod

    from dsinfer.ops.fp8 import fp8_gemm_nt

    gen = torch.Generator().manual_seed(GEN_SEED + 2)
    m, n, k = 9, 160, 384
    qa, sa = _activations(gen, m, k)
    qb, sb = (t[0] for t in _weights(gen, 1, n, k))
    ref = fp8_gemm_nt(qa, sa, qb, sb, torch.empty(m, n))
    bound = _abs_product(qa, sa, qb, sb)
    c = torch.randn(m, n, generator=gen)
    out = torch.empty(m, n)
    with launches(kmod._fp8_gemm_nt_kernel) as calls:
        kmod.fp8_gemm_nt((qa, sa), (qb, sb), out)
        _assert_gemm_close(out, ref, bound, k, "fp32 out")
        kmod.fp8_gemm_nt((qa, sa), (qb, sb), out, c)
        _assert_gemm_close(out - c, ref, bound + c.abs(), k, "fp32 out + c")
        inplace = c.clone()
        kmod.fp8_gemm_nt((qa, sa), (qb, sb), inplace, inplace)
        _assert_gemm_close(inplace - c, ref, bound + c.abs(), k, "fp32 out += (in place)")
    _expect(len(calls) == 3, f"{len(calls)} launches for 3 calls")


def check_contiguous_grouped() -> None:
    """Rows by expert: unpadded sorted segments, an empty expert, -1 rows skipped, unsorted rows."""
    from dsinfer.kernels import grouped_gemm as kmod

    gen = torch.Generator().manual_seed(GEN_SEED + 3)
    groups, n = 4, 192
    layouts = [
        [-1] * 3 + [0] * 5 + [2] * 17 + [3] * 3 + [-1] * 2,  # one row tile holding three experts
        [0] * 40 + [-1] * 24 + [1] * 7 + [3] * 29,  # DeepGEMM-style -1 padding, two row tiles
        torch.randint(-1, groups, (45,), generator=gen).tolist(),  # unsorted
        [1],  # one token
    ]
    for k in (256, 320):
        qb, sb = _weights(gen, groups, n, k)
        for layout in layouts:
            m_indices = torch.tensor(layout, dtype=torch.int32)
            qa, sa = _activations(gen, len(layout), k)
            out = torch.full((len(layout), n), float("nan"), dtype=torch.bfloat16)
            with launches(kmod._contiguous_kernel) as calls:
                kmod.m_grouped_fp8_gemm_nt_contiguous((qa, sa), (qb, sb), out, m_indices)
            what = f"contiguous k={k} m_sum={len(layout)}"
            _expect(len(calls) == 1, f"{what}: {len(calls)} launches")
            skipped = m_indices < 0
            _expect(bool(out[skipped].isnan().all()), f"{what}: a -1 row was written")
            ref, bound = _reference_rows(qa, sa, qb, sb, m_indices, n)
            _assert_gemm_close(out[~skipped], ref[~skipped], bound[~skipped], k, what)


def check_masked_grouped() -> None:
    """Per-expert rows: masked_m of 0, partial and full; rows past masked_m untouched; all empty."""
    from dsinfer.kernels import grouped_gemm as kmod

    gen = torch.Generator().manual_seed(GEN_SEED + 4)
    groups, m_max, n = 3, 20, 192
    for k, counts, expected_m in [(320, [0, 7, 20], 8), (256, [1, 0, 13], 4), (256, [0, 0, 0], 1)]:
        qb, sb = _weights(gen, groups, n, k)
        qa, sa = _activations(gen, groups, m_max, k)
        masked_m = torch.tensor(counts, dtype=torch.int32)
        out = torch.full((groups, m_max, n), float("nan"), dtype=torch.bfloat16)
        with launches(kmod._masked_kernel) as calls:
            kmod.m_grouped_fp8_gemm_nt_masked((qa, sa), (qb, sb), out, masked_m, expected_m)
        what = f"masked k={k} masked_m={counts}"
        _expect(len(calls) == 1, f"{what}: {len(calls)} launches")
        for g, count in enumerate(counts):
            _expect(bool(out[g, count:].isnan().all()), f"{what}: group {g} wrote rows past masked_m")
            rows = torch.full((count,), g)
            ref, bound = _reference_rows(qa[g, :count], sa[g, :count], qb, sb, rows, n)
            _assert_gemm_close(out[g, :count], ref, bound, k, f"{what} group {g}")


def check_masked_grouped_tma() -> None:
    """The TMA kernel (a ``TMA: 1`` tile): boxes that reach into the next group's rows (max_m and n
    not multiples of the tile) and past the last group; rows past masked_m untouched; a k that is
    not a multiple of 128 refused."""
    from dsinfer.kernels import grouped_gemm as kmod
    from dsinfer.kernels import grouped_gemm_tma

    gen = torch.Generator().manual_seed(GEN_SEED + 5)
    groups, m_max, n, k = 3, 20, 192, 256
    tile = {"BLOCK_M": 16, "BLOCK_N": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 2, "TMA": 1}
    qb, sb = _weights(gen, groups, n, k)
    qa, sa = _activations(gen, groups, m_max, k)
    counts = [20, 0, 17]
    out = torch.full((groups, m_max, n), float("nan"), dtype=torch.bfloat16)
    masked_m = torch.tensor(counts, dtype=torch.int32)
    with launches(grouped_gemm_tma._masked_tma_kernel) as calls:
        kmod.m_grouped_fp8_gemm_nt_masked((qa, sa), (qb, sb), out, masked_m, 8, tile)
    _expect(len(calls) == 1, f"masked TMA: {len(calls)} launches")
    for g, count in enumerate(counts):
        _expect(bool(out[g, count:].isnan().all()), f"masked TMA: group {g} wrote rows past masked_m")
        ref, bound = _reference_rows(qa[g, :count], sa[g, :count], qb, sb, torch.full((count,), g), n)
        _assert_gemm_close(out[g, :count], ref, bound, k, f"masked TMA group {g}")
    qa, sa = _activations(gen, groups, 256, k)  # 256 rows per group expected, k <= 2048: TMA by default
    counts = [5, 0, 3]
    out = torch.full((groups, 256, n), float("nan"), dtype=torch.bfloat16)
    masked_m = torch.tensor(counts, dtype=torch.int32)
    with launches(grouped_gemm_tma._masked_tma_kernel) as calls:
        kmod.m_grouped_fp8_gemm_nt_masked((qa, sa), (qb, sb), out, masked_m, 256)
    _expect(len(calls) == 1, "the masked default at 256 rows, k = 256 did not run the TMA kernel")
    for g, count in enumerate(counts):
        _expect(bool(out[g, count:].isnan().all()), f"masked TMA default: group {g} wrote rows past masked_m")
        ref, bound = _reference_rows(qa[g, :count], sa[g, :count], qb, sb, torch.full((count,), g), n)
        _assert_gemm_close(out[g, :count], ref, bound, k, f"masked TMA default group {g}")
    qa, sa = _activations(gen, groups, 256, 320)
    qb, sb = _weights(gen, groups, n, 320)
    with launches(kmod._masked_kernel) as calls:  # no TMA over k = 320: the default falls back
        kmod.m_grouped_fp8_gemm_nt_masked((qa, sa), (qb, sb), out, masked_m, 256)
    _expect(len(calls) == 1, "the masked default did not fall back to the pointer kernel at k = 320")
    try:
        kmod.m_grouped_fp8_gemm_nt_masked((qa, sa), (qb, sb), out, masked_m, 8, tile)
    except ValueError as exc:
        _expect("TMA kernel cannot run: k 320" in str(exc), str(exc))
    else:
        raise AssertionError("the TMA kernel took k = 320")


def check_adapter_runs_the_kernels() -> None:
    """``DeepGemmAdapter(dsinfer.kernels)`` (what select_ops builds on CUDA) matches the torch Ops."""
    import dsinfer.kernels as kernels
    from dsinfer.kernels import fp8_gemm, grouped_gemm

    from dsinfer.ops import gemm as torch_gemm
    from dsinfer.ops.external import DeepGemmAdapter, triton_gemm_adapter
    from dsinfer.ops.fp8 import quantize_activation_1x128

    gen = torch.Generator().manual_seed(GEN_SEED + 5)
    adapter = DeepGemmAdapter(kernels)
    _expect(adapter.api == "new", f"adapter sees the {adapter.api} API")
    k, n, groups = 256, 192, 3
    x = torch.randn(2, 5, k, generator=gen)
    qb, sb = _weights(gen, groups, n, k)

    def bound(a: torch.Tensor, e: int) -> torch.Tensor:
        return _abs_product(*quantize_activation_1x128(a), qb[e], sb[e])

    with launches(fp8_gemm._fp8_gemm_nt_kernel) as calls:
        y = adapter.linear(x, qb[0], sb[0])
    _expect(len(calls) == 1 and y.shape == (2, 5, n) and y.dtype == x.dtype, "linear did not run the kernel")
    _assert_gemm_close(
        y, torch_gemm.linear(x, qb[0], sb[0]), bound(x, 0).view(2, 5, n), k, "adapter linear", True
    )

    m_indices = torch.tensor([0] * 6 + [2] * 9, dtype=torch.int32)  # as model/moe.py builds it
    a = torch.randn(15, k, generator=gen)
    with launches(grouped_gemm._contiguous_kernel) as calls:
        y = adapter.grouped_gemm_contiguous(a, qb, sb, m_indices)
    _expect(len(calls) == 1, "grouped_gemm_contiguous did not run the kernel")
    ref = torch_gemm.grouped_gemm_contiguous(a, qb, sb, m_indices)
    rows_bound = torch.cat([bound(a[:6], 0), bound(a[6:], 2)])
    _assert_gemm_close(y, ref, rows_bound, k, "adapter grouped contiguous", True)

    unaligned = triton_gemm_adapter(kernels)  # what select_ops builds over dsinfer.kernels
    m_indices = torch.tensor([2, 0, -1, 2, 0, 0, -1, 2, 1, 0], dtype=torch.int32)  # unsorted, -1 rows
    a = torch.randn(10, k, generator=gen)
    with launches(grouped_gemm._contiguous_kernel) as calls:
        y = unaligned.grouped_gemm_contiguous(a, qb, sb, m_indices)
    _expect(len(calls) == 1, "the unaligned grouped_gemm_contiguous did not run the kernel")
    ref = torch_gemm.grouped_gemm_contiguous(a, qb, sb, m_indices)
    _expect(bool((y[m_indices < 0] == 0).all()), "rows with index -1 are not zero")
    rows_bound = torch.cat([bound(a[i : i + 1], max(int(e), 0)) for i, e in enumerate(m_indices)])
    _assert_gemm_close(y, ref, rows_bound, k, "adapter grouped contiguous, unaligned", True)

    a = torch.randn(groups, 8, k, generator=gen)
    masked_m = torch.tensor([3, 0, 8], dtype=torch.int32)
    with launches(grouped_gemm._masked_kernel) as calls:
        y = adapter.grouped_gemm_masked(a, qb, sb, masked_m, 4)
    _expect(len(calls) == 1, "grouped_gemm_masked did not run the kernel")
    ref = torch_gemm.grouped_gemm_masked(a, qb, sb, masked_m, 4)
    for g, count in enumerate(masked_m.tolist()):
        _assert_gemm_close(
            y[g, :count], ref[g, :count], bound(a[g, :count], g), k, f"adapter masked {g}", True
        )


def check_masked_experts_valid_rows() -> None:
    """The masked experts path over dsinfer.kernels (valid-row quantizers, masked GEMMs) against the
    torch reference: padding rows hold NaN and must never be read; the results follow the reference
    within the bf16 rounding of the first GEMM's output that the path quantizes again."""
    import dsinfer.kernels as kernels
    from dsinfer.kernels import grouped_gemm, moe_masked

    from dsinfer.ops import experts
    from dsinfer.ops.masked_moe import MaskedGemm, fp8_masked_experts, kernel_quantizers

    gen = torch.Generator().manual_seed(GEN_SEED + 6)
    slots, capacity, hidden, inner = 3, 8, 256, 128
    w13, s13 = _weights(gen, slots, 2 * inner, hidden)
    w2, s2 = _weights(gen, slots, hidden, inner)
    masked_m = torch.tensor([3, 0, 8], dtype=torch.int32)
    packed = torch.randn(slots, capacity, hidden, generator=gen)
    packed[0, 3:] = float("nan")  # padding: never read
    gemm = MaskedGemm(kernels.m_grouped_fp8_gemm_nt_masked, None, 1)
    with launches(moe_masked._masked_kernel) as activations, launches(grouped_gemm._masked_kernel) as gemms:
        y = fp8_masked_experts(gemm, kernel_quantizers(), packed, (w13, s13), (w2, s2), masked_m, 4)
    _expect(len(activations) == 2 and len(gemms) == 2, f"{len(activations)} + {len(gemms)} launches")
    ref = experts.masked_experts(packed, w13, s13, w2, s2, masked_m, 4)
    for g, count in enumerate(masked_m.tolist()):
        if count == 0:
            continue
        got, want = y[g, :count], ref[g, :count]
        _expect(bool(torch.isfinite(got).all()), f"slot {g}: padding leaked into valid rows")
        worst, scale = (got - want).abs().max(), want.abs().max()
        _expect(bool(worst <= 0.03 * scale), f"slot {g}: off by {worst:.3e} of {scale:.3e}")


def check_rejects_bad_operands() -> None:
    from dsinfer.kernels import fp8_gemm_nt, m_grouped_fp8_gemm_nt_masked

    gen = torch.Generator().manual_seed(GEN_SEED + 6)
    qa, sa = _activations(gen, 4, 256)
    qb, sb = (t[0] for t in _weights(gen, 1, 128, 256))
    out = torch.empty(4, 128, dtype=torch.bfloat16)
    bad_calls: list[tuple[type[Exception], Callable[[], None]]] = [
        (TypeError, lambda: fp8_gemm_nt((qa.float(), sa), (qb, sb), out)),
        (TypeError, lambda: fp8_gemm_nt((qa, sa), (qb, sb), out.half())),
        (ValueError, lambda: fp8_gemm_nt((qa, sa[:, :1]), (qb, sb), out)),
        (ValueError, lambda: fp8_gemm_nt((qa, sa), (qb, sb), out[:, :64])),
        (ValueError, lambda: m_grouped_fp8_gemm_nt_masked((qa[None], sa[None]), (qb[None], sb[None]),
                                                          out[None], torch.zeros(2, dtype=torch.int32), 1)),
    ]  # fmt: skip
    for i, (exc, call) in enumerate(bad_calls):
        try:
            call()
        except exc:
            continue
        raise AssertionError(f"bad call {i} did not raise {exc.__name__}")


CHECKS: tuple[Callable[[], None], ...] = (
    check_quantize_matches_reference,
    check_dense_gemm,
    check_dense_gemm_fp32_and_accumulate,
    check_contiguous_grouped,
    check_masked_grouped,
    check_masked_grouped_tma,
    check_adapter_runs_the_kernels,
    check_masked_experts_valid_rows,
    check_rejects_bad_operands,
)


def run_checks(checks: tuple[Callable[[], None], ...]) -> dict[str, str]:
    """Run each check; name -> "ok" or its failure (the subprocess side of the tests)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("set TRITON_INTERPRET=1 before triton is imported")
    results = {}
    for check in checks:
        try:
            check()
            results[check.__name__] = "ok"
        except Exception:
            results[check.__name__] = traceback.format_exc(limit=-3)
    return results


def run_in_subprocess(module: str) -> dict[str, str]:
    """``python -m module`` with TRITON_INTERPRET=1; its last stdout line is the JSON of results."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    proc = subprocess.run(
        [sys.executable, "-m", module],
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{module} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def subprocess_checks(module: str, checks: tuple[Callable[[], None], ...]) -> tuple[Any, Any]:
    """A kernel test module's pytest side: a module fixture that runs its ``checks`` in one
    interpreted subprocess (``python -m module``), and one test per check that reads its result."""

    @pytest.fixture(scope="module")
    def results() -> dict[str, str]:
        return run_in_subprocess(module)

    @pytest.mark.parametrize("check", [c.__name__ for c in checks])
    def test_kernel_check(results: dict[str, str], check: str) -> None:
        assert results.get(check) == "ok", results.get(check, "not run")

    return results, test_kernel_check


# ----------------------------------------------------------------------------- pytest side


results, test_kernel_check = subprocess_checks("tests.test_kernels_gemm", CHECKS)


if __name__ == "__main__":
    print(json.dumps(run_checks(CHECKS)))
