"""Stage ``triton-compile``: registers and stack frame (where spills land) of the block-FP8 GEMM
kernels at the configurations the ops launch, from an ahead-of-time compile with Triton's own
ptxas and cuobjdump: for this GPU's architecture on a GPU, for sm_90 (Hopper) anywhere else, so
the figures exist before a GPU does. The stage fails when a configuration does not compile. A
stack frame is reported, not judged: on the first H100 run (Triton 3.6) the fastest dense tile at
4096 rows, 64x128 with 4 warps, had a 1,384-byte frame (benchmarks/results/gpu_h100_2026-11-26/); speed is
judged by the kernels stage and benchmarks/kernels/sweep_gemm.py."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from scripts.gpukit.common import StageContext, StageResult

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
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [str(cuobjdump), "--dump-resource-usage", f.name],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    fields = next(line for line in text.splitlines() if "REG:" in line).split()
    usage = dict(item.split(":", 1) for item in fields if ":" in item)
    return {"registers": int(usage["REG"]), "stack_bytes": int(usage["STACK"])}


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
