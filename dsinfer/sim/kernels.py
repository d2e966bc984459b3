"""Kernel times from published kernel-level measurements (all on H800 SXM5), never from the
serving figures the model is compared with.

Sources (each table below repeats its numbers):

- DeepGEMM README (deepseek-ai/DeepGEMM, Feb 2025, H800 SXM5, NVCC 12.8): FP8 GEMMs with 1x128 /
  128x128 scales, the shapes of DeepSeek-V3's projections and experts, at M = 64, 128, 4096 (dense),
  4096-8192 rows per group (grouped contiguous, prefill experts) and 256-1024 (grouped masked,
  decode experts); TFLOP/s and achieved memory bandwidth.
- FlashMLA README (deepseek-ai/FlashMLA, Feb 2025, H800 SXM5): MLA decode up to 3000 GB/s when
  memory-bound, 580 TFLOP/s when compute-bound.
- FlashAttention-3 BF16 forward, head dim 128, H100 (pytorch/benchmark PR #2391, FA3 paper's
  B*S = 16k setting): 430 / 517 / 566 / 590 / 614 / 621 TFLOP/s at 0.5k / 1k / 2k / 4k / 8k / 16k
  tokens; used for MLA's prefill attention (192-dim QK, 128-dim V) on the causal FLOP count.
- DeepEP README (deepseek-ai/DeepEP, V1 "legacy" tables, H800 + CX7 400 Gb/s IB): normal kernels
  (prefill) bottleneck bandwidth 153/158 GB/s intranode EP8 (NVLink), 43/43, 58/57, 51/50 GB/s
  RDMA at EP16/32/64 (dispatch/combine); low-latency kernels (decode, 128 tokens, top-8, FP8
  dispatch, BF16 combine) 98/127, 63/74, 48/53, 43/46, 39/39, 39/40 GB/s at EP8/16/32/64/128/256.
  Normal kernels hold 20 SMs by default (``Buffer.set_num_sms``, shared/reference/kernel-apis.md);
  DeepSeek's published prefill profile (deepseek-ai/profile-data, assets/prefill.jpg) gives
  communication 24 of the 132 SMs and computation 108.

Interpolation rules (assumptions): a GEMM's time is linear in M between measured M (time = a fixed
weight-read part plus a per-row part), equal to the weight bytes over the smallest measured M's
achieved bandwidth at M = 0, and at constant TFLOP/s above the largest measured M. A shape that is
not in the table takes the nearest shape's time scaled by N*K. A BF16 GEMM takes twice the FP8
time of its shape (half the peak rate, twice the weight bytes). On another GPU the memory-bound
part is divided by its HBM bandwidth ratio (``Hardware.mem_scale``); the compute-bound part stays
(same SMs, clocks and tensor-core peak on H100/H200 as on H800). Elementwise kernels stream at
FlashMLA's 3000 GB/s and take at least ``KERNEL_FLOOR_S`` each (launch and ramp under CUDA graphs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dsinfer.sim.hardware import Hardware

KERNEL_FLOOR_S = 2e-6  # assumption: shortest duration of any kernel (launch + ramp + tail)
STREAM_BANDWIDTH = 3000e9  # FlashMLA's memory-bound figure on H800: what a streaming kernel reaches
FLASHMLA_TFLOPS = 580.0
DEEPEP_NORMAL_SMS = 20

# (N, K) -> ((M, TFLOP/s, GB/s), ...): DeepGEMM README tables, H800 SXM5.
DEEPGEMM_DENSE: dict[tuple[int, int], tuple[tuple[int, float, float], ...]] = {
    (2112, 7168): ((64, 206, 1688), (128, 352, 1509), (4096, 1058, 527)),
    (24576, 1536): ((64, 289, 2455), (128, 535, 2448), (4096, 990, 786)),
    (32768, 512): ((64, 219, 2143), (128, 358, 2103), (4096, 590, 1232)),
    (7168, 16384): ((64, 336, 2668), (128, 645, 2604), (4096, 1358, 343)),
    (4096, 7168): ((64, 287, 2320), (128, 533, 2221), (4096, 1304, 500)),
    (7168, 2048): ((64, 295, 2470), (128, 510, 2277), (4096, 1025, 697)),
}
# M is rows per group.
DEEPGEMM_CONTIGUOUS: dict[tuple[int, int], tuple[tuple[int, float, float], ...]] = {
    (4096, 7168): ((4096, 1288, 494), (8192, 1297, 418)),
    (7168, 2048): ((4096, 1093, 743), (8192, 1099, 681)),
}
DEEPGEMM_MASKED: dict[tuple[int, int], tuple[tuple[int, float, float], ...]] = {
    (4096, 7168): ((256, 932, 2064), (512, 1040, 1288), (1024, 1233, 924)),
    (7168, 2048): ((256, 815, 2047), (512, 916, 1405), (1024, 925, 968)),
}
CONTIGUOUS_ALIGN = 128  # rows: each expert segment is padded to this (DeepGEMM contiguous layout)

FA3_TFLOPS = ((512, 430.0), (1024, 517.0), (2048, 566.0), (4096, 590.0), (8192, 614.0), (16384, 621.0))

# EP size -> (dispatch GB/s, combine GB/s)
DEEPEP_NORMAL = {8: (153.0, 158.0), 16: (43.0, 43.0), 32: (58.0, 57.0), 64: (51.0, 50.0)}
DEEPEP_LOW_LATENCY = {
    8: (98.0, 127.0),
    16: (63.0, 74.0),
    32: (48.0, 53.0),
    64: (43.0, 46.0),
    128: (39.0, 39.0),
    256: (39.0, 40.0),
}
DEEPEP_NIC = 50e9  # bytes/s of the CX7 400 Gb/s NIC the DeepEP tables were measured with


@dataclass(frozen=True)
class _Curve:
    """Time (s) of one GEMM shape as a piecewise-linear function of M."""

    ms: np.ndarray  # anchor rows, ascending, starting at 0
    times: np.ndarray
    flops_per_row: float
    peak_tflops: float  # the largest measured rate of this shape

    def __call__(self, m: np.ndarray | float, mem_scale: float) -> np.ndarray:
        m = np.asarray(m, dtype=np.float64)
        inside = np.interp(m, self.ms, self.times)
        beyond = self.times[-1] * m / self.ms[-1]
        t = np.where(m > self.ms[-1], beyond, inside)
        if mem_scale != 1.0:
            t = np.maximum(t / mem_scale, m * self.flops_per_row / (self.peak_tflops * 1e12))
        return np.where(m > 0, t, 0.0)


def _curve(
    n: int, k: int, points: tuple[tuple[int, float, float], ...], weight_bytes_per_elem: float = 1.0
) -> _Curve:
    flops_per_row = 2.0 * n * k
    _, _, gbps0 = points[0]
    t0 = n * k * weight_bytes_per_elem / (gbps0 * 1e9)
    ms = [0.0] + [float(m) for m, _, _ in points]
    times = [t0] + [m * flops_per_row / (tf * 1e12) for m, tf, _ in points]
    return _Curve(np.array(ms), np.array(times), flops_per_row, max(tf for _, tf, _ in points))


def _nearest(table: dict[tuple[int, int], object], n: int, k: int) -> tuple[int, int]:
    return min(table, key=lambda s: (abs(math.log(n / s[0])) + abs(math.log(k / s[1])), s))


def _interp_log2(table: dict[int, tuple[float, float]], x: float) -> tuple[float, float]:
    keys = sorted(table)
    lx = math.log2(min(max(x, keys[0]), keys[-1]))
    xs = [math.log2(key) for key in keys]
    return (
        float(np.interp(lx, xs, [table[key][0] for key in keys])),
        float(np.interp(lx, xs, [table[key][1] for key in keys])),
    )


class Kernels:
    """Kernel times on one GPU. Every method accepts numpy arrays (one value per rank) or scalars."""

    def __init__(self, hw: Hardware) -> None:
        self.hw = hw
        self._dense = {s: _curve(*s, p) for s, p in DEEPGEMM_DENSE.items()}
        self._contiguous = {s: _curve(*s, DEEPGEMM_DENSE[s][:2] + p) for s, p in DEEPGEMM_CONTIGUOUS.items()}
        self._masked = {s: _curve(*s, p) for s, p in DEEPGEMM_MASKED.items()}

    # GEMMs ------------------------------------------------------------------------------------
    def gemm(self, m: np.ndarray | float, n: int, k: int, *, bf16: bool = False) -> np.ndarray:
        """FP8 GEMM [m, k] x [n, k]^T (DeepGEMM normal kernel); ``bf16`` doubles its time."""
        shape = _nearest(self._dense, n, k)
        t = self._dense[shape](m, self.hw.mem_scale) * (n * k) / (shape[0] * shape[1])
        return t * 2.0 if bf16 else t

    def grouped_gemm(self, rows: np.ndarray, n: int, k: int, layout: str) -> np.ndarray:
        """Per-group time of a grouped expert GEMM; ``rows`` holds each group's rows."""
        rows = np.asarray(rows, dtype=np.float64)
        if layout == "contiguous":
            rows = np.ceil(rows / CONTIGUOUS_ALIGN) * CONTIGUOUS_ALIGN
            table = self._contiguous
        elif layout == "masked":
            table = self._masked
        else:
            raise ValueError(f"unknown grouped GEMM layout {layout!r}")
        shape = _nearest(table, n, k)
        return table[shape](rows, self.hw.mem_scale) * (n * k) / (shape[0] * shape[1])

    # Attention --------------------------------------------------------------------------------
    def flash_mla(self, kv_bytes: np.ndarray, flops: np.ndarray) -> np.ndarray:
        """FlashMLA decode: the larger of streaming the latent cache and its FLOPs."""
        bw = STREAM_BANDWIDTH * self.hw.mem_scale
        return np.maximum(np.asarray(kv_bytes) / bw, np.asarray(flops) / (FLASHMLA_TFLOPS * 1e12))

    def prefill_attention(self, flops: np.ndarray, key_len: np.ndarray) -> np.ndarray:
        """FlashAttention-3-class BF16 attention: ``flops`` executed (causal) at the measured rate
        for the key length (log-interpolated, clamped to the measured range)."""
        lens = np.log2([x for x, _ in FA3_TFLOPS])
        rates = np.array([r for _, r in FA3_TFLOPS])
        key_len = np.maximum(np.asarray(key_len, dtype=np.float64), 1.0)
        tflops = np.interp(np.log2(key_len), lens, rates)
        return np.asarray(flops) / (tflops * 1e12)

    # Memory-bound small kernels ---------------------------------------------------------------
    def elementwise(self, nbytes: np.ndarray | float, kernels: int) -> np.ndarray:
        bw = STREAM_BANDWIDTH * self.hw.mem_scale
        return np.maximum(kernels * KERNEL_FLOOR_S, np.asarray(nbytes, dtype=np.float64) / bw)

    # Expert-parallel all-to-all -----------------------------------------------------------------
    def ep_bandwidth(self, ep: int, mode: str) -> tuple[float, float]:
        """(dispatch, combine) bytes/s per GPU of DeepEP at EP size ``ep``: ``mode`` "normal"
        (prefill; RDMA logical bytes, NVLink inside one node) or "low_latency" (decode)."""
        nic = self.hw.nic_bandwidth / DEEPEP_NIC
        if mode == "normal":
            if ep <= self.hw.gpus_per_node:
                d, c = DEEPEP_NORMAL[8]
                return d * 1e9 * self.hw.nvlink_scale, c * 1e9 * self.hw.nvlink_scale
            d, c = _interp_log2({k: v for k, v in DEEPEP_NORMAL.items() if k > 8}, ep)
        elif mode == "low_latency":
            d, c = _interp_log2(DEEPEP_LOW_LATENCY, ep)
        else:
            raise ValueError(f"unknown DeepEP mode {mode!r}")
        return d * 1e9 * nic, c * 1e9 * nic

    def comm_sm_slowdown(self, comm_sms: int = DEEPEP_NORMAL_SMS) -> float:
        """Compute slows by this factor while DeepEP normal kernels hold ``comm_sms`` SMs (and by
        the hardware's in-situ interference beyond that, 1.0 unless measured)."""
        if not 0 <= comm_sms < self.hw.sms:
            raise ValueError(f"comm_sms must be in [0, {self.hw.sms}), got {comm_sms}")
        return self.hw.sms / (self.hw.sms - comm_sms) / self.hw.overlap_compute_efficiency
