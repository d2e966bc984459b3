"""Online EPLB in a DeepSeek-V4 expert-parallel pool (dsinfer/engine/v4_expert_balancer.py): two
rank processes find a better placement from the window's load, stage their new slots' experts
from the checkpoint (or their own slots) at step boundaries, swap at the same step, and serve the
tokens a pool that never moved serves; the MTP layer's experts move like every layer's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.v4_checkpoints import TOKENIZER_VOCAB, add_v4_mtp, build_v4

pytest.importorskip("transformers")
pytestmark = pytest.mark.system

OUTPUT = 12


def test_v4_pool_rebalances_online_and_keeps_its_tokens(tmp_path: Path) -> None:
    from tests.test_ep import run_pool

    directory = tmp_path / "v4"
    build_v4("flash_like", directory, with_tokenizer=True)
    add_v4_mtp(directory, 0.3)
    g = torch.Generator().manual_seed(9)
    prompts = [
        torch.randint(2, TOKENIZER_VOCAB, (n,), generator=g).tolist() for n in (30, 45, 60, 75, 90, 120)
    ]
    engine = {
        "num_redundant_experts": 2,
        "max_num_seqs": 8,
        "kv_cache_memory": "16MiB",
        "speculative_mtp": True,
    }
    still = run_pool(directory, 2, tmp_path, prompts, max_tokens=OUTPUT, **engine)
    moving = run_pool(
        directory, 2, tmp_path, prompts, max_tokens=OUTPUT, eplb_interval=3, eplb_min_gain=0.0, **engine
    )
    assert {rid: t for r in moving for rid, t in r["tokens"].items()} == {
        rid: t for r in still for rid, t in r["tokens"].items()
    }
    events = [r["rebalances"] for r in moving]
    assert all(e and e[0]["swap_step"] is not None for e in events), events
    assert events[0][0]["swap_step"] == events[1][0]["swap_step"]  # every rank swapped at the same step
    assert events[0][0]["balance_after"] < events[0][0]["balance_before"]
    assert [r["v4_local_experts"] for r in moving] != [r["v4_local_experts"] for r in still]
    layers = 5 + 1  # the MTP layer's MoE is placed too
    assert all(len(r["v4_local_experts"]) == layers for r in moving)
    assert all(r["free_pages_ok"] for r in moving)


@pytest.mark.parametrize("packed", [False, True], ids=["float", "mxfp4"])
def test_staged_experts_are_the_loaded_ones(packed: bool, tmp_path: Path) -> None:
    """Slots staged for another placement, from this rank's slots where it holds the expert and
    from the checkpoint where it does not, equal the slots a rank loaded with that placement:
    dequantised, or (``mxfp4``: the release's experts kept packed) their bytes and scales."""
    from types import SimpleNamespace

    from dsinfer.base.v4_config import V4Config
    from dsinfer.model.moe import ExpertParallel
    from dsinfer.model.v4_experts import V4ExpertSource
    from dsinfer.model.v4_loader import load_v4
    from dsinfer.model.v4_moe import V4MoE
    from dsinfer.ops import select_ops
    from dsinfer.parallel.placement import ExpertPlacement

    source_dir = tmp_path / "source"
    build_v4("pro_like", source_dir, with_tokenizer=False)
    add_v4_mtp(source_dir)
    directory = source_dir
    if packed:
        from tests.test_v4_model import _release_quantized

        _release_quantized(source_dir, tmp_path / "release", tmp_path / "dequantized")
        directory = tmp_path / "release"
    config = V4Config.model_validate_json((directory / "config.json").read_text())
    layers = range(config.num_hidden_layers + 1)
    first = ExpertPlacement(2, 8, {layer: (0, 1, 2, 3, 4, 5, 6, 7, 0, 1) for layer in layers})
    other = ExpertPlacement(2, 8, {layer: (7, 3, 1, 5, 0, 6, 2, 4, 3, 5) for layer in layers})
    group = SimpleNamespace(rank=1)
    ops = select_ops("cpu", "torch")

    def moes(placement: ExpertPlacement) -> dict[str, V4MoE]:
        ep = ExpertParallel(placement, group)  # type: ignore[arg-type]
        model = load_v4(directory, ops, ep=ep, keep_mxfp4=packed, num_mtp_layers=1)
        return {f"model.{n}": m for n, m in model.named_modules() if isinstance(m, V4MoE)}

    held, wanted = moes(first), moes(other)
    source = V4ExpertSource(directory, num_mtp_layers=1)
    staging = source.stage({name: moe.local_experts for name, moe in wanted.items()}, held)
    while staging.fill_next():
        pass
    for name, moe in wanted.items():
        experts, tensors = staging.modules[name]
        assert experts == moe.local_experts
        assert moe.mxfp4 == packed
        for t in moe.expert_tensor_names:
            assert torch.equal(tensors[t], getattr(moe, t)), (name, t)
    source.close()
