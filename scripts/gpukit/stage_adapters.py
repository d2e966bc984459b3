"""Stage ``adapters``: the ``Ops`` adapters of the GPU kernels against the torch references on the
same inputs, and DeepEP's buffer sizes.

- GEMM: ``DeepGemmAdapter`` over dsinfer.kernels (the ``triton`` backend) and over ``deep_gemm``
  where it imports on SM90: dense, grouped contiguous (unsorted rows, -1 rows) and grouped masked
  with a row count that is not a multiple of DeepGEMM's tile (the padding fix);
- MLA: dsinfer.kernels' ``mla_decode`` and, where ``flash_mla`` imports on SM90, the FlashMLA
  adapter (bf16; metadata built once for three calls of one step; float32 sent to the Triton
  fallback);
- DeepEP (where ``deep_ep`` imports; one GPU cannot run it): the low-latency RDMA size hint for the
  per-token sizing against the old per-pair sizing, and the queue-pair depth.

Under ``--cpu-smoke`` the Triton adapters run under the interpreter at small shapes and the
libraries are reported absent (skip) unless installed."""

from __future__ import annotations

import importlib
from typing import Any

from .common import StageContext, StageResult

GEMM_TOL = 2e-2  # bf16 outputs of fp8 products: max |diff| / max |ref|
MLA_TOL, LSE_TOL = 2e-2, 1e-3


def _gemm_checks(result: StageResult, name: str, adapter: Any, device: Any, smoke: bool) -> None:
    import torch

    import harness.kernels as bench
    from dsinfer.ops import gemm as ref
    from dsinfer.ops.fp8 import quantize_weight_128x128

    g = torch.Generator(device=device).manual_seed(1)
    n, k = (256, 256) if smoke else (2048, 7168)
    x = torch.randn(24, k, device=device, dtype=torch.bfloat16, generator=g)
    w, ws = quantize_weight_128x128(torch.randn(n, k, device=device, generator=g))
    errs = {"dense": bench.rel_err(adapter.linear(x, w, ws), ref.linear(x, w, ws))}
    groups = 3
    pairs = [quantize_weight_128x128(torch.randn(n, k, device=device, generator=g)) for _ in range(groups)]
    gw, gs = torch.stack([q for q, _ in pairs]), torch.stack([sc for _, sc in pairs])
    idx = torch.tensor([2, 0, -1, 2, 1, 1, 0, -1, 2, 0] * 2, dtype=torch.int32, device=device)
    a = torch.randn(idx.numel(), k, device=device, dtype=torch.bfloat16, generator=g)
    errs["contiguous"] = bench.rel_err(
        adapter.grouped_gemm_contiguous(a, gw, gs, idx), ref.grouped_gemm_contiguous(a, gw, gs, idx)
    )
    m = 24  # a decode bucket: not a multiple of DeepGEMM's 64/128-row tiles
    am = torch.randn(groups, m, k, device=device, dtype=torch.bfloat16, generator=g)
    masked_m = torch.tensor([24, 7, 13], dtype=torch.int32, device=device)
    got = adapter.grouped_gemm_masked(am, gw, gs, masked_m, 12)
    want = ref.grouped_gemm_masked(am, gw, gs, masked_m, 12)
    errs["masked"] = max(bench.rel_err(got[e, :c], want[e, :c]) for e, c in enumerate(masked_m.tolist()))
    result.figures[f"{name} gemm rel err"] = {key: round(v, 5) for key, v in errs.items()}
    for key, err in errs.items():
        result.check(f"{name} {key} GEMM = torch reference", err <= GEMM_TOL, f"{err:.2e}")


def _mla_checks(
    result: StageResult, name: str, mla: Any, device: Any, smoke: bool, adapter: Any = None
) -> None:
    import torch

    import harness.kernels as bench
    from dsinfer.ops import mla as ref

    g = torch.Generator(device=device).manual_seed(2)
    batch, heads, page = 3, 16 if smoke else 128, 64
    lens = torch.tensor([70, 5, 129] if smoke else [4000, 17, 1025], dtype=torch.int32, device=device)
    pages = -(-int(lens.max()) // page)
    cache = torch.randn(batch * pages + 1, page, 1, 576, device=device, dtype=torch.bfloat16, generator=g)
    table = torch.randperm(batch * pages, device=device, generator=g).to(torch.int32).view(batch, pages)
    worst = {}
    for s_q in (1, 2):
        q = torch.randn(batch, s_q, heads, 576, device=device, dtype=torch.bfloat16, generator=g)
        for _ in range(3):  # three layers of one step
            out, lse = mla(q, cache, table, lens, 512, 0.1352, True)
        want, want_lse = ref.mla_decode(q, cache, table, lens, 512, 0.1352, True)
        worst[f"s_q={s_q}"] = (bench.rel_err(out, want), bench.max_abs_err(lse, want_lse))
    for key, (err, lse_err) in worst.items():
        result.check(
            f"{name} MLA decode {key} = torch reference",
            err <= MLA_TOL and lse_err <= LSE_TOL,
            f"out {err:.2e}, lse {lse_err:.2e}",
        )
    result.figures[f"{name} mla err (out, lse)"] = {
        k: [round(a, 5), round(b, 6)] for k, (a, b) in worst.items()
    }
    if adapter is not None:
        result.figures[f"{name} metadata builds (2 steps x 3 layers)"] = adapter.metadata_builds
        result.check(
            f"{name} metadata built once per step", adapter.metadata_builds == 2, str(adapter.metadata_builds)
        )
        q32 = torch.randn(batch, 1, heads, 576, device=device, generator=g)
        out32, _ = mla(q32, cache.float(), table, lens, 512, 0.1352, True)
        want32, _ = ref.mla_decode(q32, cache.float(), table, lens, 512, 0.1352, True)
        err32 = bench.rel_err(out32, want32)
        result.check(
            f"{name} float32 through the fallback = torch reference", err32 <= MLA_TOL, f"{err32:.2e}"
        )


def _sparse_probes(result: StageResult, backend: str, module: Any, device: Any) -> None:
    """What the V3.2 adapters make of the installed library (their checks against the references
    are the kernels stage's sparse section)."""
    from dsinfer.ops.external_sparse import DeepGemmIndexerAdapter, FlashMlaSparseAdapter

    try:
        if backend == "deepgemm":
            ix = DeepGemmIndexerAdapter(module)
            result.figures["deep_gemm indexer probed"] = {
                "api": ix.api,
                "context_lens_2d": ix.context_lens_2d,
            }
        else:
            sparse = FlashMlaSparseAdapter(module, device=device)
            result.figures["flash_mla sparse probed"] = {
                "lse_base": sparse.lse_base,
                "lse_probe": sparse.lse_probe,
            }
    except Exception as exc:  # reported; the adapter is then not selected by select_ops either
        result.figures[f"{backend} V3.2 adapter"] = f"not built: {type(exc).__name__}: {exc}"


def _deep_ep(result: StageResult) -> None:
    from dsinfer.engine.args import EngineArgs
    from dsinfer.parallel.deepep import missing_buffer_api
    from dsinfer.parallel.deepep_layout import low_latency_qp_depth

    try:
        module = importlib.import_module("deep_ep")
    except Exception as exc:
        result.figures["deep_ep"] = f"absent ({type(exc).__name__})"
        return
    why = missing_buffer_api(module)
    result.check("deep_ep exports the legacy Buffer API", why is None, why or "")
    if why is not None:
        return
    tokens = EngineArgs().decode_tokens_per_step()
    ranks, experts, hidden = 144, 288, 7168  # the decode EP144 profile: 256 experts + 32 redundant
    size = module.Buffer.get_low_latency_rdma_size_hint(tokens, hidden, ranks, experts)
    old = module.Buffer.get_low_latency_rdma_size_hint(128 * 8, hidden, ranks, experts)
    result.figures["deep_ep low-latency RDMA bytes per GPU (EP144, 288 experts)"] = {
        f"{tokens} tokens (per token)": f"{size / 2**30:.2f} GiB",
        "1024 pair rows (before)": f"{old / 2**30:.2f} GiB",
    }
    result.figures["deep_ep QP depth needed"] = low_latency_qp_depth(tokens)
    result.check("per-token sizing is smaller than the per-pair one", size < old, f"{size} vs {old}")


def run(ctx: StageContext, result: StageResult) -> None:
    import dsinfer.kernels as kernels
    import torch

    from dsinfer.ops.backend import capability_unsupported
    from dsinfer.ops.external import DeepGemmAdapter, FlashMlaAdapter, triton_gemm_adapter

    device = torch.device(ctx.device)
    _gemm_checks(result, "triton", triton_gemm_adapter(kernels), device, ctx.cpu_smoke)
    _mla_checks(result, "triton", kernels.mla_decode, device, ctx.cpu_smoke)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    present = []
    for backend, name in (("deepgemm", "deep_gemm"), ("flashmla", "flash_mla")):
        try:
            module = importlib.import_module(name)
        except Exception as exc:
            result.figures[name] = f"absent ({type(exc).__name__})"
            continue
        why = "no GPU" if capability is None else capability_unsupported(backend, capability)
        if why is not None:
            result.figures[name] = f"present, not usable: {why}"
            continue
        present.append(name)
        result.figures[name] = f"{getattr(module, '__version__', '?')} from {module.__file__}"
        if backend == "deepgemm":
            gemm = DeepGemmAdapter(module)
            result.figures["deep_gemm probed"] = {"api": gemm.api, "m_alignment": gemm.m_alignment}
            _gemm_checks(result, "deep_gemm", gemm, device, ctx.cpu_smoke)
        else:
            adapter = FlashMlaAdapter(module, fallback=kernels.mla_decode)
            result.figures["flash_mla probed"] = {
                "api": adapter.api,
                "passes_use_legacy": adapter.passes_use_legacy,
            }
            _mla_checks(result, "flash_mla", adapter.mla_decode, device, ctx.cpu_smoke, adapter)
        _sparse_probes(result, backend, module, device)
    _deep_ep(result)
    failed = [c.name for c in result.checks if not c.ok]
    result.summary = (
        f"{len(result.checks) - len(failed)}/{len(result.checks)} checks ok; external libraries checked: "
        + (", ".join(present) or "none present")
    )
