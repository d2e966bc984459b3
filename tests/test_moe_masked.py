"""The graph-safe routed-expert path (masked layout, device-side ranks and counts) against the
contiguous one, and the DeepGEMM contiguous-layout padding helper."""

from __future__ import annotations

import pytest
import torch

from dsinfer.base.config import ModelConfig
from dsinfer.base.presets import presets_dir
from dsinfer.model.moe import MoE, masked_layout
from dsinfer.ops import gemm as torch_gemm
from dsinfer.ops import select_ops
from dsinfer.ops.external import contiguous_padding
from dsinfer.ops.fp8 import quantize_weight_128x128

CONFIG = ModelConfig.from_file(presets_dir() / "tiny" / "config.json")  # 16 experts, top-4, H 256


def _moe(fp8: bool, seed: int = 0) -> MoE:
    g = torch.Generator().manual_seed(seed)
    moe = MoE(CONFIG, select_ops("cpu"), layer_id=1)
    for name, p in moe.named_parameters():
        p.copy_(torch.randn(p.shape, generator=g) * (0.5 if "bias" in name else 0.08))
    if fp8:
        w13, w2 = moe.experts.w13.clone(), moe.experts.w2.clone()
        moe.experts.make_fp8()
        for s in range(w13.shape[0]):
            for weight, scale, dense in (
                (moe.experts.w13, moe.experts.w13_scale_inv, w13),
                (moe.experts.w2, moe.experts.w2_scale_inv, w2),
            ):
                assert scale is not None
                q, sc = quantize_weight_128x128(dense[s])
                weight.data[s], scale.data[s] = q, sc
    return moe


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


def test_masked_layout_ranks_and_counts() -> None:
    slots = torch.tensor([3, 0, 3, -1, 1, 3, 0, 7, 5])  # 7 is out of range (5 slots): skipped like -1
    layout = masked_layout(slots, 5)
    assert layout.valid.tolist() == [True, True, True, False, True, True, True, False, False]
    assert layout.masked_m.tolist() == [2, 1, 0, 3, 0]
    valid = layout.valid
    assert layout.rank[valid].tolist() == [0, 0, 1, 0, 2, 1]  # arrival order within each slot
    assert layout.slot[~valid].tolist() == [5, 5, 5] and layout.rank[~valid].tolist() == [0, 0, 0]


@pytest.mark.parametrize("fp8", [False, True], ids=["f32", "fp8"])
def test_masked_experts_match_contiguous(fp8: bool) -> None:
    """Experts.compute_masked == Experts.compute row for row (skipped rows zero), same slot load."""
    experts = _moe(fp8).experts
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(40, CONFIG.hidden_size, generator=g)
    slots = torch.randint(0, 16, (40,), generator=g)
    slots[torch.tensor([3, 17, 29])] = -1
    keep = slots >= 0
    with torch.inference_mode():
        expected = experts.compute(rows[keep], slots[keep])
        load_contiguous = experts.slot_load.clone()
        experts.slot_load.zero_()
        got = experts.compute_masked(rows, slots)
    _close(got[keep], expected)
    assert (got[~keep] == 0).all()
    assert experts.slot_load.tolist() == load_contiguous.tolist()


def test_masked_moe_matches_contiguous_and_skips_padding() -> None:
    """MoE.forward through the masked layout with padding rows: the real rows' outputs and the
    expert-load counters equal those of the contiguous path over the real rows alone."""
    moe = _moe(fp8=False, seed=2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(11, CONFIG.hidden_size, generator=g)
    mask = torch.ones(11, dtype=torch.bool)
    mask[torch.tensor([2, 7, 8])] = False  # padding rows of a captured batch
    with torch.inference_mode():
        expected = moe(x[mask])
        load, slot_load = moe.expert_load.clone(), moe.experts.slot_load.clone()
        moe.expert_load.zero_()
        moe.experts.slot_load.zero_()
        got = moe(x, token_mask=mask, masked=True)
    _close(got[mask], expected)
    assert moe.expert_load.tolist() == load.tolist()
    assert moe.experts.slot_load.tolist() == slot_load.tolist()
    assert int(load.sum()) == 8 * CONFIG.num_experts_per_tok
    with pytest.raises(ValueError, match="masked routed path only"):
        moe(x, token_mask=mask)


@pytest.mark.parametrize("alignment", [1, 4, 128])
def test_contiguous_padding_segments_are_aligned(alignment: int) -> None:
    """DeepGEMM's contiguous layout: each group's rows together, in group order, each segment a
    multiple of ``alignment`` rows, padding -1; rows keep their order within a group."""
    m_indices = torch.tensor([2, 0, 2, -1, 5, 0, 2, 5, -1, 0], dtype=torch.int32)
    layout = contiguous_padding(m_indices, alignment)
    counts = {0: 3, 2: 3, 5: 2}
    assert layout.num_rows == sum(-(-c // alignment) * alignment for c in counts.values())
    padded = layout.m_indices.tolist()
    start = 0
    for group in sorted(counts):  # groups in order, each one aligned segment
        size = -(-counts[group] // alignment) * alignment
        segment = padded[start : start + size]
        assert segment == [group] * counts[group] + [-1] * (size - counts[group]), (group, padded)
        assert start % alignment == 0
        start += size
    assert start == len(padded)
    dest = layout.dest.tolist()
    assert [dest[i] for i in (1, 5, 9)] == sorted(dest[i] for i in (1, 5, 9))  # order kept in group 0
    assert dest[3] == dest[8] == -1
    # pad -> grouped GEMM on the padded rows -> unpad equals the GEMM on the rows as they came
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(10, 32, generator=g), torch.randn(6, 24, 32, generator=g)
    out = torch_gemm.grouped_gemm_contiguous(layout.pad(a), b, None, layout.m_indices)
    _close(layout.unpad(out), torch_gemm.grouped_gemm_contiguous(a, b, None, m_indices))
    assert (layout.unpad(out)[m_indices < 0] == 0).all()


def test_contiguous_padding_edge_cases() -> None:
    empty = contiguous_padding(torch.tensor([], dtype=torch.int32), 128)
    assert empty.num_rows == 0 and empty.dest.numel() == 0
    skipped = contiguous_padding(torch.tensor([-1, -1], dtype=torch.int32), 128)
    assert skipped.num_rows == 0 and skipped.dest.tolist() == [-1, -1]
    with pytest.raises(ValueError, match="alignment"):
        contiguous_padding(torch.tensor([0]), 0)
