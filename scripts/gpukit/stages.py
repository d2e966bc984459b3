"""The kit's stages, in the order they run: the module that implements each, its time limit on a GPU
(and under ``--cpu-smoke``), and what it proves (docs/gpu.md says more)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    name: str
    module: str  # scripts.gpukit.<module> defines run(ctx, result)
    budget_s: float  # on a GPU
    smoke_budget_s: float  # under --cpu-smoke
    proves: str


STAGES: tuple[Stage, ...] = (
    Stage(
        "env", "stage_env", 60, 60, "GPU, driver, torch, triton, NCCL; deep_gemm / flash_mla / deep_ep import"
    ),
    Stage(
        "triton-compile",
        "stage_compile",
        120,
        90,
        "registers and stack frames (spills) of the GEMM kernels at the configurations the ops launch",
    ),
    Stage("gpu-tests", "stage_tests", 300, 120, "the @pytest.mark.gpu tests"),
    Stage(
        "parity",
        "stage_parity",
        300,
        120,
        "tokens of a tiny model: transformers float32 = engine CPU = GPU float32 with and without "
        "CUDA graphs; GPU bf16 and the FP8 checkpoint compared statistically; the trained model in "
        "FP8 answers as the CPU FP8 path does",
    ),
    Stage(
        "adapters",
        "stage_adapters",
        240,
        120,
        "the GEMM and MLA adapters (Triton, DeepGEMM, FlashMLA where present) against the torch "
        "references; DeepEP's buffer sizes",
    ),
    Stage(
        "server",
        "stage_server",
        300,
        150,
        "the all-in-one PD server (prefill and decode on one GPU, KV over NIXL) through the openai "
        "client = the offline engine",
    ),
    Stage(
        "v3-engine",
        "stage_v3",
        360,
        120,
        "reduced-depth full-width DeepSeek-V3 (FP8 dummy weights): prefill and decode through the "
        "engine, step times (a warm-up round first)",
    ),
    Stage(
        "v3-graphs",
        "stage_v3_graphs",
        360,
        120,
        "the same model's decode step eager, static and replayed from CUDA graphs "
        "(benchmarks/kernels/bench_decode_graph.py)",
    ),
    Stage(
        "kernels",
        "stage_kernels",
        480,
        150,
        "copy and matmul ceilings, MLA decode, dense and grouped FP8 GEMMs, gate, V3.2's indexer and "
        "sparse MLA as fractions of the ceilings, DeepGEMM and FlashMLA beside them where present "
        "(benchmarks/kernels/bench_kernels.py --quick)",
    ),
    Stage(
        "sweeps",
        "stage_sweeps",
        240,
        150,
        "MLA decode launches (TMA and pointer kernels) at B128 x 4K, 16 and 128 heads, and the FP8 "
        "GEMM tiles, timed around the defaults",
    ),
    Stage(
        "ncu",
        "stage_ncu",
        120,
        90,
        "one Nsight Compute launch each of MLA decode (128 heads) and the masked grouped GEMM: "
        "throughput against the peaks, occupancy",
    ),
)
BY_NAME = {stage.name: stage for stage in STAGES}
