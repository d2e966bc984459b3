"""Dummy weights: seeded by tensor name and logical expert id, identical on every rank and replica."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dsinfer.base.presets import presets_dir
from dsinfer.model.loader import CheckpointError, load_model
from dsinfer.ops import select_ops

OPS = select_ops(torch.device("cpu"))


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in model.state_dict().items()}


def test_dummy_weights_are_reproducible() -> None:
    a, b = load_model("tiny", OPS), load_model("tiny", OPS)
    assert a.load_format == "dummy" and len(a.model.mtp_layers) == 1
    sa, sb = _state(a.model), _state(b.model)
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    other_seed = _state(load_model("tiny", OPS, seed=1).model)
    assert not torch.equal(other_seed["lm_head.weight"], sa["lm_head.weight"])


def test_a_rank_hosting_some_experts_builds_the_same_experts() -> None:
    full = load_model("tiny", OPS).model
    part = load_model("tiny", OPS, expert_ids=[9, 2, 9]).model  # a redundant replica of expert 9
    for layer_full, layer_part in zip(full.model.layers[1:], part.model.layers[1:], strict=True):
        w_full, w_part = layer_full.mlp.experts.w13, layer_part.mlp.experts.w13
        assert torch.equal(w_part[0], w_full[9]) and torch.equal(w_part[1], w_full[2])
        assert torch.equal(w_part[2], w_full[9])


def test_dummy_fp8_follows_deepseeks_checkpoint(tmp_path: Path) -> None:
    model_dir = tmp_path / "tiny-fp8"
    shutil.copytree(presets_dir() / "tiny", model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (model_dir / "config.json").write_text(json.dumps(config))
    loaded = load_model(model_dir, replace(OPS, supports_fp8_gemm=True), load_format="dummy")
    layer = loaded.model.model.layers[1]
    assert layer.self_attn.kv_a_proj_with_mqa.weight.dtype == torch.float8_e4m3fn
    assert layer.mlp.experts.w13.dtype == torch.float8_e4m3fn
    assert layer.mlp.gate.weight.dtype == torch.float32 and loaded.model.lm_head.weight.dtype == torch.float32
    assert loaded.model.mtp_layers[0].eh_proj.weight.dtype == torch.float32


def test_directory_without_weights_is_refused(tmp_path: Path) -> None:
    shutil.copy(presets_dir() / "tiny" / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors files \(use load_format 'dummy'"):
        load_model(tmp_path, OPS)
    with pytest.raises(CheckpointError, match="load_format 'pt' unknown"):
        load_model(tmp_path, OPS, load_format="pt")
    assert load_model(tmp_path, OPS, load_format="dummy").load_format == "dummy"


def test_bf16_load_packs_every_dense_linear_with_the_same_results() -> None:
    from dsinfer.model.layers import Linear
    from dsinfer.ops.gemm import PACKED_F32_MIN_ELEMENTS, WIDENED_MIN_ROWS

    model = load_model("tiny", OPS, dtype=torch.bfloat16).model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    run = [m for m in linears if not m.stacked_into]  # q_a and kv_a run as their stack's rows
    assert linears and all(m.packed is not None for m in run) and len(run) < len(linears)
    assert all(m.packed is None for m in linears if m.stacked_into)
    gen = torch.Generator().manual_seed(0)
    for m in linears:
        for rows in (5, WIDENED_MIN_ROWS):
            x = torch.randn(rows, m.in_features, generator=gen).bfloat16()
            if m.packed is None or m.packed.dtype == torch.bfloat16 or rows < WIDENED_MIN_ROWS:
                assert torch.equal(m(x), torch.nn.functional.linear(x, m.weight))  # a bf16 GEMM
                continue
            # no bf16 GEMMs on this CPU: the weight widened, the product in float32
            widened = torch.nn.functional.linear(x.float(), m.weight.float()).bfloat16()
            if m.packed.is_mkldnn:  # and packed, as a float32 weight of its size is
                torch.testing.assert_close(m(x), widened, rtol=2**-7, atol=1e-2)
            else:
                assert torch.equal(m(x), widened)
    fp32 = load_model("tiny", OPS, dtype=torch.float32).model
    fp32_run = [m for m in fp32.modules() if isinstance(m, Linear) and not m.stacked_into]
    big = [m for m in fp32_run if m.weight.numel() >= PACKED_F32_MIN_ELEMENTS]
    assert big and all(m.packed is not None and m.packed.is_mkldnn for m in big)
    assert all(m.packed is None for m in fp32_run if m not in big)
    for m in big:
        x = torch.randn(3, m.in_features, generator=gen)
        torch.testing.assert_close(m(x), torch.nn.functional.linear(x, m.weight), rtol=1e-5, atol=1e-4)


def test_linear_stack_runs_its_parts_as_one_gemm() -> None:
    """Linear.stack: the stack's rows are the parts' (its output split equals theirs), the parts'
    tensors become views of the stack's, FP8 scale blocks follow their rows; it refuses parts
    whose scale blocks would straddle two of them, or whose bias or inputs differ. A loaded V3
    model runs q_a and kv_a as one stack."""
    from dsinfer.model.layers import Linear
    from dsinfer.ops.fp8 import quantize_weight_128x128

    gen = torch.Generator().manual_seed(3)
    parts = [Linear(256, n, OPS, bias=True) for n in (256, 72)]
    for p in parts:
        p.weight.copy_(torch.randn(p.weight.shape, generator=gen))
        p.bias.copy_(torch.randn(p.bias.shape, generator=gen))  # type: ignore[union-attr]
    x = torch.randn(4, 256, generator=gen)
    want = [p(x) for p in parts]
    stacked = Linear.stack(parts)
    assert stacked is not None and stacked.out_features == 328 and all(p.stacked_into for p in parts)
    for got, ref in zip(stacked(x).split([256, 72], dim=-1), want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert parts[1].weight.data_ptr() == stacked.weight.data_ptr() + 256 * 256 * 4  # a view, no copy
    assert parts[1].bias.data_ptr() == stacked.bias.data_ptr() + 256 * 4  # type: ignore[union-attr]

    fp8 = [Linear(256, n, OPS) for n in (128, 72)]
    for p in fp8:
        w, s = quantize_weight_128x128(torch.randn(p.out_features, 256, generator=gen))
        p.make_fp8()
        p.weight.copy_(w)
        p.weight_scale_inv.copy_(s)  # type: ignore[union-attr]
    dense = torch.cat([p.dense_weight(torch.float32) for p in fp8])
    stacked = Linear.stack(fp8)
    assert stacked is not None and stacked.weight_scale_inv is not None
    assert tuple(stacked.weight_scale_inv.shape) == (2, 2)
    assert torch.equal(stacked.dense_weight(torch.float32), dense)
    assert torch.equal(fp8[1].dense_weight(torch.float32), dense[128:])

    straddling = [Linear(256, n, OPS) for n in (72, 128)]
    for p in straddling:
        p.make_fp8()
    assert Linear.stack(straddling) is None  # 72 rows: the second part's first block would be shared
    assert Linear.stack([Linear(256, 8, OPS, bias=True), Linear(256, 8, OPS)]) is None
    assert Linear.stack([Linear(256, 8, OPS), Linear(128, 8, OPS)]) is None

    model = load_model("tiny", OPS).model
    attn = model.model.layers[0].self_attn
    assert attn.a_proj is not None and attn.q_a_proj.stacked_into and attn.kv_a_proj_with_mqa.stacked_into
    # and every SwiGLU MLP (the dense layers', the shared experts') its gate and up rows
    for mlp in (model.model.layers[0].mlp, model.model.layers[1].mlp.shared_experts):
        assert mlp.gate_up is not None and mlp.gate_proj.stacked_into and mlp.up_proj.stacked_into
        x = torch.randn(5, mlp.gate_proj.in_features, generator=gen)
        apart = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        torch.testing.assert_close(mlp(x), apart, rtol=1e-5, atol=1e-5)
