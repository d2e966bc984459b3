"""MLA decode's launch policy: which kernel, which tiles, how many KV splits (dsinfer.kernels.mla_decode
launches; benchmarks and the GPU kit read the same choices)."""

from __future__ import annotations

from typing import NamedTuple

import torch

MIN_KEYS_PER_SPLIT = 256  # below this a split costs more in the combine than it saves
MAX_SPLITS = 64
# H100, B128 x 4K, 16 heads, pointer kernel 16x32 w4 s3 (2026-11-28): 2 splits 240 us, 5 splits 276,
# 10 splits 260 (2026-11-26, s2: 6 splits 258 us, 3 splits 293): one program per SM at B128
PROGRAMS_PER_SM = 1
# The TMA kernel holds 221 KB of shared memory: one program per SM at a time. H100, B128 x 4K, 128
# heads, one program per row block (2026-11-28): 1 split 542 us, 2 splits 589
TMA_PROGRAMS_PER_SM = 1
CPU_SMS = 8  # what the split heuristic assumes when there is no CUDA device (the interpreter)


class MlaLaunch(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    kernel: str  # "tma" (mla_decode_tma.py: Hopper) or "pointer" (mla_decode.py's, any GPU)
    dv_parts: int  # output-channel parts per row block (the TMA kernel's; 1 for the pointer kernel)


def default_launch(rows: int, compute: torch.dtype) -> MlaLaunch:
    """The launch for ``rows = s_q * h_q`` query rows computed in ``compute``.

    From the H100 sweeps of 2026-11-27 and 2026-11-28 (benchmarks/results/gpu_h100_2026-11-27/,
    gpu_h100_2026-11-28/), B x 4K contexts: more than 32 rows in 16-bit (V3's 128 heads) take the
    TMA kernel in 64-row blocks with 8 warps, 64-key tiles and one program per row block (both
    256-channel boxes, scores once): 542 us at B128, 128 heads, against 938 us for two channel
    parts (each computing the scores), 782 us with 32-key tiles and 1,708 us for the pointer
    kernel's 32-row blocks. Up to 32 rows stay on the pointer kernel: padded to a 64-row block the
    TMA kernel was slower there (B128, 16 heads: 421 against 240 us). One 16-row block runs best
    with 4 warps and 3 stages (240 us at B128 x 4K, 16 heads; 248 with 2 stages, 390 with 8 warps).
    Where the TMA kernel cannot run (:func:`tma_unsupported`), :func:`pointer_fallback` gives the
    pointer kernel's 32-row blocks. float32 uses 16 x 16 tiles (IEEE fp32 dots, no wgmma).
    """
    if compute == torch.float32:
        return MlaLaunch(16, 16, 8, 2, "pointer", 1)
    if rows <= 16:
        return MlaLaunch(16, 32, 4, 3, "pointer", 1)
    if rows <= 32:
        return MlaLaunch(32, 32, 8, 2, "pointer", 1)
    return MlaLaunch(64, 64, 8, 2, "tma", 1)


def pointer_fallback(launch: MlaLaunch) -> MlaLaunch:
    """The pointer kernel's launch where the TMA kernel cannot run: 64-row blocks spill there, so
    32-row blocks (mma.sync; no spill)."""
    if launch.kernel == "pointer":
        return launch
    return MlaLaunch(min(launch.block_m, 32), min(launch.block_n, 32), 8, launch.num_stages, "pointer", 1)


def choose_num_splits(
    batch: int,
    row_blocks: int,
    max_keys: int,
    num_sms: int,
    block_n: int,
    programs_per_sm: int = PROGRAMS_PER_SM,
) -> int:
    """KV splits per sequence: enough programs for ``programs_per_sm`` per SM, at least
    ``MIN_KEYS_PER_SPLIT`` keys (rounded to tiles) per split, at most ``MAX_SPLITS``.
    ``row_blocks``: the programs per sequence and split (the TMA kernel's channel parts count)."""
    programs = max(1, batch * row_blocks)
    wanted = -(-programs_per_sm * num_sms // programs)
    min_tiles = max(1, MIN_KEYS_PER_SPLIT // block_n)
    by_length = -(-max_keys // block_n) // min_tiles
    return max(1, min(wanted, by_length, MAX_SPLITS))


def sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_SMS
