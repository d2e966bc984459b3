"""DeepSeek-V4's cache groups (dsinfer/base/kv_groups.py) against what the model itself holds
(dsinfer/model/v4_state.py ``cache_bytes``, which tests/test_v4_model.py checks against the model's
own cache), on the released configs and a tiny one: exact bytes per group equal, the state slot
is the compressors' most, and a paged pool holds less than a page more per group, with the
window's pages bounded whatever the context."""

from __future__ import annotations

import json

import pytest

from dsinfer.base.kv_groups import HybridCacheSpec
from dsinfer.base.presets import resolve_model
from dsinfer.base.v4_config import V4Config
from dsinfer.model.v4_state import cache_bytes

CONTEXTS = (0, 1, 3, 4, 127, 128, 129, 255, 256, 257, 1000, 4096, 32768 + 77)
TINY = dict(
    vocab_size=300, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=5, num_attention_heads=4,
    head_dim=32, qk_rope_head_dim=8, q_lora_rank=16, o_groups=2, o_lora_rank=16, sliding_window=16,
    index_n_heads=8, index_head_dim=16, index_topk=4, hc_mult=2, n_routed_experts=4, num_experts_per_tok=2,
    compress_ratios=[0, 4, 128, 4, 128], num_hash_layers=1,
)  # fmt: skip


def _configs() -> list[V4Config]:
    presets = [
        json.loads((resolve_model(p)[0] / "config.json").read_text())
        for p in ("deepseek-v4-flash", "deepseek-v4-pro")
    ]
    return [V4Config.model_validate(c) for c in (*presets, TINY)]


@pytest.mark.parametrize("config", _configs(), ids=["flash", "pro", "tiny"])
def test_groups_hold_what_the_model_holds(config: V4Config) -> None:
    spec = HybridCacheSpec.for_v4(config, "bfloat16")
    states = []
    for tokens in CONTEXTS:
        model = cache_bytes(config, tokens, 2)
        exact = spec.exact_bytes(tokens)
        assert exact["window"] == model["window"]
        assert exact.get("c4", 0) + exact.get("c128", 0) == model["compressed"]
        assert exact.get("c4_indexer", 0) == model["indexer"]
        states.append(model["compressor_state"])
        paged = spec.paged_bytes(tokens)
        for group in spec.groups:
            assert (
                0 <= paged[group.name] - exact[group.name] < spec.page_bytes(group) or group.name == "window"
            )
    assert max(states) <= spec.state_bytes
    worst = max(cache_bytes(config, n, 2)["compressor_state"] for n in range(128, 512))
    assert worst == spec.state_bytes  # some context reaches it


def test_window_pages_stay_bounded() -> None:
    spec = HybridCacheSpec.for_v4(_configs()[0], "bfloat16")  # window 127 rows, pages of 256 tokens
    window = spec.group("window")
    assert window is not None
    assert [spec.pages(window, n) for n in (0, 1, 256, 257, 300, 10**6)] == [0, 1, 1, 2, 2, 2]
    assert spec.paged_bytes(10**6)["window"] == spec.paged_bytes(300)["window"]


def test_page_geometry_must_fit_every_rate() -> None:
    with pytest.raises(ValueError, match="not a multiple"):
        HybridCacheSpec.for_v4(_configs()[0], "bfloat16", page_tokens=64)  # HCA's 128-token entries
