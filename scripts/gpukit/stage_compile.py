"""Stage ``triton-compile``: registers, stack frame (where spills land) and tensor-core instructions
of the block-FP8 GEMM kernels at the configurations the ops launch and of the MLA decode kernels at
their default launches, from an ahead-of-time compile with Triton's own ptxas and cuobjdump: for
this GPU's architecture on a GPU, for sm_90a (Hopper) anywhere else, so the figures exist before a
GPU does (the CPU smoke in the test-suite runs it too).

The stage fails when a configuration does not compile, and when MLA decode at V3's 128 heads (the
TMA kernel's default launch) is not on wgmma (``HGMMA`` in the SASS; ``HMMA`` is mma.sync). Stack
frames are reported, not judged: this compile lacks the JIT's argument specialization (its 64-key
MLA tiles spill 120-128 bytes with Triton 3.9 here, the builds the H100 launched with Triton 3.6
none: the kernels stage lists those), and on the first H100 run (Triton 3.6) the fastest
dense tile at 4096 rows, 64x128 with 4 warps, had a 1,384-byte frame
(benchmarks/results/gpu_h100_2026-11-26/); speed is judged by the kernels stage and
benchmarks/kernels/sweep_gemm.py."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from .common import StageContext, StageResult

ROWS = (1, 16, 64, 256, 4096)  # per expert (grouped) or per GEMM (dense)
N = (576, 4096, 7168)  # V3's kv_a_proj_with_mqa, expert w13 (gate + up), hidden


def _signature(kernel: Any, constexprs: dict[str, Any]) -> dict[str, str]:
    """Triton's argument types, from the GEMM kernels' naming: fp8 operands, fp32 scales, a bf16
    output, int32 indices and sizes; ``constexprs`` name the compile-time ones."""
    types = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "sa_ptr": "*fp32", "sb_ptr": "*fp32", "d_ptr": "*bf16"}
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = types.get(name, "*i32")
        else:
            sig[name] = "i32"
    return sig


def _usage(cubin: bytes, cuobjdump: Path) -> dict[str, int]:
    """Registers, stack bytes and the tensor-core instructions in the SASS: wgmma (``*GMMA``:
    HGMMA for bf16, QGMMA for fp8) and mma.sync (``HMMA``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()

        def dump(flag: str) -> str:
            argv = [str(cuobjdump), flag, f.name]
            return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout

        text, sass = dump("--dump-resource-usage"), dump("-sass")
    fields = next(line for line in text.splitlines() if "REG:" in line).split()
    usage = dict(item.split(":", 1) for item in fields if ":" in item)
    return {
        "registers": int(usage["REG"]),
        "stack_bytes": int(usage["STACK"]),
        "gmma": len(re.findall(r"\b[A-Z]GMMA\b", sass)),
        "hmma": len(re.findall(r"\bHMMA\b", sass)),
    }


def _mla_sources(tl: Any) -> list[tuple[str, Any, dict[str, str], dict[str, Any], dict[str, int]]]:
    """(name, kernel, signature, constexprs, options) of the MLA decode kernels at the launches
    ``default_launch`` picks for V3 (576 = 512 latent + 64 rope, page 64, bf16): 128 heads (the TMA
    kernel, split and final outputs), 16 heads and the 32-row fallback (the pointer kernel)."""
    import torch
    from dsinfer.kernels import mla_decode_tma
    from dsinfer.kernels.mla_decode import _mla_decode_split_kernel, default_launch, pointer_fallback
    from dsinfer.kernels.mla_launch import MlaLaunch

    sources = []
    wide = default_launch(128, torch.bfloat16)
    others = [MlaLaunch(64, 32, 8, 2, "tma", 1), MlaLaunch(64, 64, 8, 2, "tma", 2)]  # the sweep's next best
    tma_builds = [(wide, True), (wide, False), *((launch, True) for launch in others if launch != wide)]
    for launch, split in tma_builds:
        box = mla_decode_tma.value_box(512, launch.dv_parts)
        const = dict(DV=512, DPE=64, PAGE_SIZE=64, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BOX=box,
                     DV_PARTS=launch.dv_parts, CAUSAL=True, SPLIT=split, DOT=tl.bfloat16)  # fmt: skip
        descs = {
            "kv_desc": f"tensordesc<bf16[{launch.block_n}, {box}]>",
            "pe_desc": f"tensordesc<bf16[{launch.block_n}, 64]>",
        }
        sig = _mla_signature(mla_decode_tma._mla_decode_tma_kernel, const, descs)
        name = (
            f"mla {launch.kernel} 128 heads {launch.block_m}x{launch.block_n}x{launch.dv_parts} "
            f"w{launch.num_warps}" + (" split" if split else "")
        )
        options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
        sources.append((name, mla_decode_tma._mla_decode_tma_kernel, sig, const, options))
    for label, launch in (
        ("16 heads", default_launch(16, torch.bfloat16)),
        ("fallback", pointer_fallback(wide)),
    ):
        const = dict(DV=512, DPE=64, BLOCK_DV=512, BLOCK_PE=64, PAGE_SIZE=64, BLOCK_M=launch.block_m,
                     BLOCK_N=launch.block_n, CAUSAL=True, SPLIT=True, COMPUTE=tl.bfloat16, DOT=tl.bfloat16,
                     DOT_PRECISION="tf32")  # fmt: skip
        sig = _mla_signature(_mla_decode_split_kernel, const, {})
        name = f"mla pointer {label} {launch.block_m}x{launch.block_n} w{launch.num_warps}"
        sources.append(
            (
                name,
                _mla_decode_split_kernel,
                sig,
                const,
                {"num_warps": launch.num_warps, "num_stages": launch.num_stages},
            )
        )
    return sources


def _mla_signature(kernel: Any, constexprs: dict[str, Any], descs: dict[str, str]) -> dict[str, str]:
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in descs:
            sig[name] = descs[name]
        elif name in ("q_ptr", "kv_ptr", "out_ptr"):
            sig[name] = "*bf16"
        elif name == "lse_ptr":
            sig[name] = "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = "*i32"
        elif name == "scale_log2":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def run(ctx: StageContext, result: StageResult) -> None:
    os.environ.pop("TRITON_INTERPRET", None)  # this stage compiles for real
    import torch
    import triton
    from dsinfer.kernels import fp8_gemm, grouped_gemm
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.is_file():
        result.skipped = f"Triton ships no cuobjdump here ({cuobjdump})"
        return
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        arch = major * 10 + minor
    else:
        arch = 90
    target = GPUTarget("cuda", arch, 32)
    kernels = [
        ("dense", fp8_gemm._fp8_gemm_nt_kernel, fp8_gemm.tile_config, {"ACCUMULATE": False}),
        ("masked", grouped_gemm._masked_kernel, fp8_gemm.tile_config, {}),
        ("contiguous", grouped_gemm._contiguous_kernel, grouped_gemm.contiguous_tile_config, {}),
    ]
    configs: dict[str, dict[str, Any]] = {}
    for name, kernel, config_of, extra in kernels:
        for m in ROWS if not ctx.cpu_smoke else ROWS[1:3]:
            for n in N:
                cfg = config_of(m, n)
                key = f"{name} {cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']}"
                if key in configs:
                    continue
                constexprs = {
                    "BLOCK_M": cfg["BLOCK_M"],
                    "BLOCK_N": cfg["BLOCK_N"],
                    "GROUP_M": cfg["GROUP_M"],
                    "EVEN_K": True,
                    **extra,
                }
                source = ASTSource(kernel, _signature(kernel, constexprs), constexprs)
                options = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
                try:
                    compiled = triton.compile(source, target=target, options=options)
                except Exception as exc:  # any compiler error fails this configuration
                    result.check(f"{key}: compiles", False, f"{type(exc).__name__}: {str(exc)[:300]}")
                    continue
                configs[key] = _usage(compiled.asm["cubin"], cuobjdump)
                result.check(f"{key}: compiles", True, str(configs[key]))
    mla: dict[str, dict[str, int]] = {}
    for name, kernel, sig, const, options in _mla_sources(triton.language):
        try:
            compiled = triton.compile(ASTSource(kernel, sig, const), target=target, options=options)
        except Exception as exc:
            result.check(f"{name}: compiles", False, f"{type(exc).__name__}: {str(exc)[:300]}")
            continue
        mla[name] = _usage(compiled.asm["cubin"], cuobjdump)
        result.check(f"{name}: compiles", True, str(mla[name]))
        if " 128 heads " in name and arch == 90:
            u = mla[name]
            result.check(
                f"{name}: on wgmma", u["gmma"] > 0 and u["hmma"] == 0, f"GMMA {u['gmma']}, HMMA {u['hmma']}"
            )
    result.figures["mla"] = mla
    result.figures["target"] = f"sm_{arch}" + ("a" if arch == 90 else "")
    result.figures["kernels"] = configs
    if not configs:
        result.summary = "no configuration compiled"
        return
    worst = max(configs.items(), key=lambda kv: kv[1]["stack_bytes"])
    result.summary = (
        f"{len(configs)} GEMM configurations for {result.figures['target']}; largest stack frame "
        f"{worst[1]['stack_bytes']} B ({worst[0]}, {worst[1]['registers']} registers)"
    )
