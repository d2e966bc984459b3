"""GPU and node figures the cost model is parameterized by.

Datasheet values (NVIDIA H100/H200 datasheets; the H800 SXM5 is the H100 SXM5 with NVLink cut to
400 GB/s, shared/reference/deepseek-v3.md "H800 SXM datasheet leads"):

| GPU | dense FP8 | dense BF16 | HBM | HBM bandwidth | NVLink | NIC per GPU | SMs |
|---|---|---|---|---|---|---|---|
| H800 SXM5 | 1979 TFLOP/s | 989 TFLOP/s | 80 GB HBM3 | 3.35 TB/s | 400 GB/s | CX7 400 Gb/s IB | 132 |
| H100 SXM5 | 1979 | 989 | 80 GB HBM3 | 3.35 TB/s | 900 GB/s | CX7 400 Gb/s IB | 132 |
| H200 SXM | 1979 | 989 | 141 GB HBM3e | 4.8 TB/s | 900 GB/s | CX7 400 Gb/s IB | 132 |

The kernel tables in :mod:`dsinfer.sim.kernels` were measured on H800 SXM5; ``mem_scale`` (this
GPU's HBM bandwidth over the H800's) rescales their memory-bound parts and ``nvlink_scale`` the
intranode all-to-all. Where ``benchmarks/results/gpu_ceilings_<name>.json`` exists (a measured
override of any field here) :func:`with_measured` applies it; none exists yet (no GPU
measurements have been taken for this project).

``overlap_compute_efficiency`` is not a datasheet figure: the fraction of its unit-test rate a
compute kernel keeps while DeepEP's normal kernels run beside it (prefill two-batch overlap),
beyond the SMs they hold. SGLang and DeepSeek both measured kernels slower in situ than alone
(lmsys.org large-scale-ep blog, "Detail Breakdown") without publishing the factor in numbers, so
the default is 1.0 (no interference) until a measurement replaces it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

H800_HBM_BANDWIDTH = 3.35e12  # bytes/s: the GPU the kernel tables were measured on
H800_NVLINK = 400e9


@dataclass(frozen=True)
class Hardware:
    name: str
    fp8_tflops: float  # dense peak, TFLOP/s
    bf16_tflops: float
    hbm_bytes: float
    hbm_bandwidth: float  # bytes/s
    nvlink_bandwidth: float  # bytes/s, bidirectional per GPU
    nic_bandwidth: float  # bytes/s per GPU (one NIC per GPU)
    gpus_per_node: int = 8
    sms: int = 132
    overlap_compute_efficiency: float = 1.0  # measured override only (see the module docstring)

    def __post_init__(self) -> None:
        if not 0.0 < self.overlap_compute_efficiency <= 1.0:
            raise ValueError(
                f"overlap_compute_efficiency must be in (0, 1], got {self.overlap_compute_efficiency}"
            )

    @property
    def mem_scale(self) -> float:
        return self.hbm_bandwidth / H800_HBM_BANDWIDTH

    @property
    def nvlink_scale(self) -> float:
        return self.nvlink_bandwidth / H800_NVLINK


H800 = Hardware("h800", 1979.0, 989.0, 80e9, 3.35e12, 400e9, 50e9)
H100 = Hardware("h100", 1979.0, 989.0, 80e9, 3.35e12, 900e9, 50e9)
H200 = Hardware("h200", 1979.0, 989.0, 141e9, 4.8e12, 900e9, 50e9)
HARDWARE = {hw.name: hw for hw in (H800, H100, H200)}


def get_hardware(name: str) -> Hardware:
    try:
        return HARDWARE[name.lower()]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; choose one of {', '.join(HARDWARE)}") from None


def with_measured(hw: Hardware, results_dir: Path) -> tuple[Hardware, Path | None]:
    """``hw`` with the fields of ``results_dir/gpu_ceilings_<name>.json`` (measured on that GPU)
    replacing the datasheet's, and the file used (None when there is none)."""
    path = Path(results_dir) / f"gpu_ceilings_{hw.name}.json"
    if not path.is_file():
        return hw, None
    data = json.loads(path.read_text())
    known = {f.name for f in fields(Hardware)} - {"name"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{path}: unknown fields {unknown} (known: {sorted(known)})")
    return replace(hw, **{k: type(getattr(hw, k))(v) for k, v in data.items()}), path
