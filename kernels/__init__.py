"""The project's own Triton kernels, shipped as ``dsinfer.kernels``.

ops/ selects a kernel from here only on a GPU, and only when this package provides it (checked by
name). Each kernel has a test against its torch reference that runs on CPU under
``TRITON_INTERPRET=1`` (tests/test_kernels_*.py). An op whose kernel is not here runs its torch
reference.

- ``mla_decode``: MLA decode over the paged latent cache (FlashMLA semantics, split-KV), with
  the ``Ops`` signature; more than 16 query rows in 16-bit run the Hopper kernel of
  ``mla_decode_tma`` (TMA page tiles, 64-row blocks on wgmma).
- ``indexer_logits``: DeepSeek-V3.2's lightning-indexer logits over the paged (plain or FP8) key
  cache; ops adds the top-k.
- ``sparse_mla_decode``: MLA decode over the cache slots each query picked (FlashMLA's sparse
  semantics), with the ``Ops`` signature.
- ``quantize_activation_1x128``, ``fp8_gemm_nt``, ``m_grouped_fp8_gemm_nt_contiguous``,
  ``m_grouped_fp8_gemm_nt_masked``: block-FP8 GEMMs with DeepGEMM's newer names and semantics
  (1x128 activation scales, 128x128 weight scales, fp32 accumulation).
- ``quantize_masked_1x128``, ``swiglu_quantize_masked``: the masked MoE layout's activations over
  its valid rows only (the expert input's quantization; SwiGLU fused with the second input's).
- ``moe_gate``: the fused noaux_tc gate (sigmoid, bias for selection, group-limited top-k,
  renormalization and scaling), with the ``Ops`` signature.
- ``pool_windows``: DeepSeek-V4's compressor pooling (a softmax over each window's rows, the
  rows summed under it), with the ``Ops`` signature.
- ``mxfp4_grouped_gemm``: DeepSeek-V4's routed experts with MXFP4 weights dequantised in the
  kernel, with the ``Ops`` signature (unverified on a GPU).
"""

from .fp8_gemm import fp8_gemm_nt as fp8_gemm_nt
from .fp8_gemm import quantize_activation_1x128 as quantize_activation_1x128
from .grouped_gemm import m_grouped_fp8_gemm_nt_contiguous as m_grouped_fp8_gemm_nt_contiguous
from .grouped_gemm import m_grouped_fp8_gemm_nt_masked as m_grouped_fp8_gemm_nt_masked
from .indexer import indexer_logits as indexer_logits
from .mla_decode import mla_decode as mla_decode
from .moe_gate import moe_gate as moe_gate
from .moe_masked import quantize_masked_1x128 as quantize_masked_1x128
from .moe_masked import swiglu_quantize_masked as swiglu_quantize_masked
from .mxfp4_gemm import mxfp4_grouped_gemm as mxfp4_grouped_gemm
from .sparse_mla import sparse_mla_decode as sparse_mla_decode
from .v4_compress import pool_windows as pool_windows
