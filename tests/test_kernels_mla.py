"""The Triton MLA decode kernel (``dsinfer.kernels.mla_decode``) against the torch reference.

On CPU the kernels run under ``TRITON_INTERPRET=1``. Triton reads that variable when a kernel is
decorated, i.e. when ``dsinfer.kernels`` is first imported, and any other test module may already
have imported Triton or ``dsinfer.kernels`` in this pytest process. So the CPU checks run in one
fresh subprocess (this file run as a script, with ``TRITON_INTERPRET=1`` in its environment) that
prints one JSON line per case; each test asserts on its case's line. This pytest process itself
never imports ``dsinfer.kernels`` off a GPU.

Each case records the launches of the two jitted kernels through Triton's pre-run hooks (the split
count each got), so a test fails if the wrapper answered without running the Triton kernels. On a
CUDA machine one more test runs the same cases, plus a production-sized batch, compiled on the GPU.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.system

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


@dataclass(frozen=True)
class Case:
    seqlens: tuple[int, ...]
    page_size: int
    s_q: int
    heads: int
    dim: int  # latent + rope channels of q and the cache
    dim_v: int  # value channels: the first dim_v of the cache
    dtype: str
    causal: bool
    num_splits: int | None  # None: through the Ops entry point `mla_decode` and its split heuristic
    expect_splits: int
    block_m: int | None = None
    kv_dtype: str | None = None  # None: same as dtype
    strided: bool = False  # q with strided heads, a 3-D cache unsqueezed like the model's, int64 table
    expect_kernel: str = "pointer"  # "tma": mla_decode_tma.py's kernel (16-bit, > 16 rows, whole-page tiles)
    kernel: str | None = None  # forced through mla_decode_split_kv (None: the default launch)
    dv_parts: int | None = None


CASES: dict[str, Case] = {
    # ragged lengths, partial last pages, an empty sequence
    "ragged_fp32": Case((5, 70, 1, 0), 8, 1, 4, 24, 16, "float32", False, 1, 1),
    # s_q = 2 with the bottom-right causal mask; a length-1 sequence leaves its first query empty
    "causal_two_tokens_split3_fp32": Case((7, 2, 40, 1), 8, 2, 3, 24, 16, "float32", True, 3, 3),
    # rows (2 x 12) over two row blocks of 16, the second half-padded
    "row_blocks_strided_split2_fp32": Case(
        (33, 17), 8, 2, 12, 24, 16, "float32", True, 2, 2, block_m=16, strided=True
    ),
    "bf16_split2": Case((45, 12, 3), 8, 2, 4, 24, 16, "bfloat16", True, 2, 2),
    "fp32_q_bf16_cache": Case((20, 9), 8, 1, 4, 24, 16, "float32", False, 2, 2, kv_dtype="bfloat16"),
    # DeepSeek-V3's shape: 512 latent + 64 rope, page 64
    # 16 heads x 2 tokens = 32 rows: the pointer kernel (the TMA kernel was slower there on the H100)
    "v3_bf16_two_tokens_split3": Case((130, 64, 1), 64, 2, 16, 576, 512, "bfloat16", True, 3, 3),
    # V3's 128 heads: two 64-row blocks by TMA, each one program over all 512 value channels; one split
    "v3_bf16_128_heads_tma": Case(
        (130, 64, 1), 64, 1, 128, 576, 512, "bfloat16", True, None, 1, expect_kernel="tma"
    ),
    # the TMA kernel with split partials in bf16, one channel part, NaN in the slots past the ends
    "tma_one_part_split2": Case(
        (40, 7, 1, 33),
        32,
        1,
        24,
        48,
        32,
        "bfloat16",
        False,
        2,
        2,
        expect_kernel="tma",
        kernel="tma",
        dv_parts=1,
    ),
    # V3's 512 value channels in one program (two TMA boxes, scores once), 2 tokens x 32 heads,
    # split partials: whole tiles, a tail tile past the length (NaN there), a split of one tail
    "v3_tma_one_program_two_boxes": Case(
        (130, 64, 7, 1),
        64,
        2,
        32,
        576,
        512,
        "bfloat16",
        True,
        2,
        2,
        expect_kernel="tma",
        kernel="tma",
        dv_parts=1,
    ),
    # pages of 8 slots cannot hold a 32-key tile: more than 16 rows fall back to the pointer kernel
    "tma_fallback_small_pages": Case((45, 12, 3), 8, 2, 12, 48, 32, "bfloat16", True, 2, 2),
    # the heuristic splits: table 11 pages = 704 keys = 44 fp32 tiles of 16, >= 16 tiles per split
    # -> 2 splits (the interpreter assumes 8 SMs: 16 programs wanted for 2 x 1 row blocks)
    "v3_fp32_heuristic_splits": Case((600, 300), 64, 1, 16, 576, 512, "float32", False, None, 2),
    # the heuristic keeps a short context in one split and skips the combine kernel
    "v3_bf16_one_token_heuristic": Case((90, 7), 64, 1, 16, 576, 512, "bfloat16", True, None, 1),
}
SCRIPT_CHECKS = ("exports", "split_heuristic", "edge_inputs")


def _paged_inputs(case: Case, device: torch.device) -> tuple[torch.Tensor, ...]:
    """q, k_cache, block_table, cache_seqlens: each sequence's tokens on shuffled pages; free pages
    and the slots past a sequence's length hold NaN, unused table entries -1."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    seqlens = list(case.seqlens)
    pages_per_seq = [-(-n // case.page_size) for n in seqlens]
    num_blocks = sum(pages_per_seq) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    cache = torch.full((num_blocks, case.page_size, case.dim), float("nan"))
    table = torch.full((len(seqlens), max(pages_per_seq) + 1), -1, dtype=torch.int64)
    used = 0
    for b, n in enumerate(seqlens):
        for p in range(pages_per_seq[b]):
            block = int(perm[used])
            used += 1
            table[b, p] = block
            count = min(case.page_size, n - p * case.page_size)
            cache[block, :count] = torch.randn(count, case.dim, generator=gen)
    q = torch.randn(len(seqlens), case.s_q, case.heads * (2 if case.strided else 1), case.dim, generator=gen)
    if case.strided:
        q = q[:, :, ::2]
    else:
        table = table.to(torch.int32)
    q = q.to(device=device, dtype=getattr(torch, case.dtype))
    cache = cache.to(device=device, dtype=getattr(torch, case.kv_dtype or case.dtype))
    k_cache = cache.unsqueeze(2) if case.strided else cache.view(num_blocks, case.page_size, 1, case.dim)
    lens = torch.tensor(seqlens, dtype=torch.int32, device=device)
    return q, k_cache, table.to(device), lens


def run_case(case: Case, device: torch.device, launches: list[tuple[str, int]]) -> None:
    """Raise if the kernel disagrees with the reference or did not launch as ``case`` expects.
    ``launches`` is filled by pre-run hooks on the two kernels (see ``_hooks``)."""
    from dsinfer.kernels import mla_decode as kernel_entry
    from dsinfer.kernels.mla_decode import mla_decode_split_kv

    from dsinfer.ops.mla import mla_decode as reference

    q, k_cache, table, lens = _paged_inputs(case, device)
    scale = 0.6 / case.dim**0.5
    args = (q, k_cache, table, lens, case.dim_v, scale, case.causal)
    launches.clear()
    if case.num_splits is None:
        out, lse = kernel_entry(*args)
    else:
        out, lse = mla_decode_split_kv(
            *args,
            num_splits=case.num_splits,
            block_m=case.block_m,
            kernel=case.kernel,
            dv_parts=case.dv_parts,
        )
    combines = 1 if case.expect_splits > 1 else 0
    expected = [(case.expect_kernel, case.expect_splits)] + [("combine", case.expect_splits)] * combines
    assert launches == expected, launches
    ref_out, ref_lse = reference(*args)
    assert out.shape == ref_out.shape and out.dtype == q.dtype, (out.shape, out.dtype)
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32, (lse.shape, lse.dtype)
    # 16-bit: P is rounded to bf16 before P @ V (as in FlashMLA) and out is rounded once more
    tol = 2e-2 if torch.bfloat16 in (q.dtype, k_cache.dtype) else 1e-5
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-4)  # +inf rows must match too
    empty = torch.isinf(ref_lse).permute(0, 2, 1)  # [B, s_q, h_q]
    assert bool((out[empty] == 0).all())


def _check_exports() -> None:
    import inspect

    import dsinfer.kernels

    from dsinfer.ops.backend import TRITON_FEATURES
    from dsinfer.ops.mla import mla_decode as reference

    for name in TRITON_FEATURES["mla"]:
        assert hasattr(dsinfer.kernels, name), name
    assert inspect.signature(dsinfer.kernels.mla_decode) == inspect.signature(reference)


def _check_split_heuristic() -> None:
    from dsinfer.kernels.mla_decode import MAX_SPLITS, choose_num_splits

    # batch, row blocks, max keys (block-table width x page size), SMs, block_n
    assert choose_num_splits(1, 4, 32768, 132, 32) == 33  # one long sequence: a program per SM
    assert choose_num_splits(1, 1, 32768, 132, 32, 4) == MAX_SPLITS  # capped
    assert choose_num_splits(1, 4, 4096, 132, 32) == 16  # capped at 256 keys per split
    assert choose_num_splits(256, 4, 32768, 132, 32) == 1  # the batch alone fills the GPU
    assert choose_num_splits(16, 4, 32768, 132, 32) == 3
    assert choose_num_splits(1, 1, 200, 132, 32) == 1  # short context: one split


def _check_edge_inputs() -> None:
    from dsinfer.kernels.mla_decode import mla_decode_split_kv

    k_cache = torch.zeros(2, 8, 1, 24)
    table = torch.zeros(0, 1, dtype=torch.int32)
    out, lse = mla_decode_split_kv(torch.zeros(0, 1, 4, 24), k_cache, table, torch.zeros(0), 16, 0.1, True)
    assert out.shape == (0, 1, 4, 16) and lse.shape == (0, 4, 1)
    bad_inputs = (
        {"k_cache": torch.zeros(2, 8, 2, 24)},
        {"head_dim_v": 25},
        {"block_m": 24},
        {"kernel": "wgmma"},
        {"kernel": "tma"},  # float32 inputs: the TMA kernel takes 16-bit ones only
    )
    for bad in bad_inputs:
        kwargs = {"k_cache": k_cache, "head_dim_v": 16, **bad}
        q, lens = torch.zeros(1, 1, 4, 24), torch.ones(1, dtype=torch.int32)
        with pytest.raises(ValueError):
            mla_decode_split_kv(
                q,
                kwargs.pop("k_cache"),
                torch.zeros(1, 1, dtype=torch.int32),
                lens,
                kwargs.pop("head_dim_v"),
                0.1,
                True,
                **kwargs,
            )


def _hooks(launches: list[tuple[str, int]]) -> list[tuple[Any, Callable[..., None]]]:
    """(kernel, hook) pairs that record (kernel, num_splits) for each launch of the three kernels."""
    # the submodule itself: the package attribute `mla_decode` is the function it exports
    module = importlib.import_module("dsinfer.kernels.mla_decode")
    tma = importlib.import_module("dsinfer.kernels.mla_decode_tma")

    def split(*args: Any, **kwargs: Any) -> None:
        launches.append(("pointer", int(args[7])))

    def split_tma(*args: Any, **kwargs: Any) -> None:
        launches.append(("tma", int(args[8])))

    def combine(*args: Any, **kwargs: Any) -> None:
        launches.append(("combine", int(args[4])))

    return [
        (module._mla_decode_split_kernel, split),
        (tma._mla_decode_tma_kernel, split_tma),
        (module._mla_decode_combine_kernel, combine),
    ]


def _main(names: list[str]) -> None:
    """Subprocess entry: one JSON line per check, ``error`` None when it passed."""
    import triton

    launches: list[tuple[str, int]] = []
    for kernel, hook in _hooks(launches):
        kernel.add_pre_run_hook(hook)
    checks: dict[str, Callable[[], None]] = {
        "exports": _check_exports,
        "split_heuristic": _check_split_heuristic,
        "edge_inputs": _check_edge_inputs,
    }
    for name in names:
        try:
            if name in checks:
                checks[name]()
            else:
                run_case(CASES[name], torch.device("cpu"), launches)
            error = None
        except Exception:
            error = traceback.format_exc()
        print(json.dumps({"check": name, "error": error, "triton": triton.__version__}), flush=True)


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict[str, Any]]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    names = [*SCRIPT_CHECKS, *CASES]
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, __file__, *names], env=env, cwd=root, capture_output=True, text=True, timeout=600
    )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            result = json.loads(line)
            results[result["check"]] = result
    assert proc.returncode == 0 and len(results) == len(names), proc.stdout[-3000:] + proc.stderr[-3000:]
    return results


@needs_triton
@pytest.mark.parametrize("name", [*SCRIPT_CHECKS, *CASES])
def test_interpreted_kernel(interpreted: dict[str, dict[str, Any]], name: str) -> None:
    assert interpreted[name]["error"] is None, interpreted[name]["error"]


@pytest.mark.gpu
@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_kernel_on_gpu() -> None:
    from dsinfer.kernels import mla_decode

    from dsinfer.ops import select_ops

    ops = select_ops("cuda", prefer="triton")
    assert ops.backends["mla"] == "triton" and ops.mla_decode is mla_decode
    launches: list[tuple[str, int]] = []
    hooks = _hooks(launches)
    for kernel, hook in hooks:
        kernel.add_pre_run_hook(hook)
    try:
        device = torch.device("cuda")
        for case in CASES.values():
            if case.num_splits is not None:  # the heuristic's split counts assume the interpreter's SMs
                run_case(case, device, launches)
        big = Case((4000, 1, 64, 1777), 64, 2, 128, 576, 512, "bfloat16", True, 8, 8, expect_kernel="tma")
        run_case(big, device, launches)
        big_pointer = Case(
            (4000, 1, 64, 1777), 64, 2, 128, 576, 512, "bfloat16", True, 8, 8, kernel="pointer", block_m=32
        )
        run_case(big_pointer, device, launches)
        launches.clear()
        out, _ = mla_decode(*_paged_inputs(big, device), 512, 0.1, True)  # the heuristic's split count
        assert torch.isfinite(out).all() and launches and launches[0][0] == "tma", launches
    finally:
        for kernel, hook in hooks:
            kernel.pre_run_hooks.remove(hook)


if __name__ == "__main__":
    _main(sys.argv[1:])
