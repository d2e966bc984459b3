"""Kernel entry points: block-FP8 GEMM, grouped expert GEMMs, MLA decode, MoE gate, sampling.

Each has a torch reference (the semantics of DeepGEMM / FlashMLA / DeepSeek's gate) and backends
chosen once at start-up by :func:`select_ops`; the model calls only the returned :class:`Ops`.
"""

from dsinfer.ops.backend import BACKENDS, KERNELS, Ops, compile_ahead, parse_prefer, select_ops
from dsinfer.ops.gemm import packed_pays
from dsinfer.ops.sampling import SamplingTensors, compute_logprobs

__all__ = [
    "BACKENDS",
    "KERNELS",
    "Ops",
    "SamplingTensors",
    "compile_ahead",
    "compute_logprobs",
    "packed_pays",
    "parse_prefer",
    "select_ops",
]
