"""dsinfer's model, loaded from a transformers-written checkpoint, against transformers' logits.

Both MLA paths are checked: full-prompt prefill through the decompressed path, and token-by-token
decode through the absorbed path over the paged latent cache (prompts span several pages). The
"v32_sparse" configuration is DeepSeek-V3.2 (DeepseekV32ForCausalLM): its indexer keeps 12 keys per
query, so from the 13th token on every path runs sparse attention; its comparisons stop at the
indexer cut (harness/hf_reference.py), which must leave the sparse positions compared.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dsinfer.cache.kv_pool import PagedKVPool
from dsinfer.model.batch import ForwardBatch
from dsinfer.model.loader import LoadedModel, load_model
from dsinfer.ops import select_ops
from harness.checkpoints import (
    FP8_OVERRIDES,
    ROPE_VARIANTS,
    V32_OVERRIDES,
    BuiltCheckpoint,
    build_checkpoint,
)
from harness.hf_reference import compare, hf_last_hidden, hf_logits, indexer_cut, mtp_reference

DECOMPRESSED, ABSORBED = False, True  # which MLA path a step takes
PAGE = 16  # small pages so that a 40-token prompt spans three of them, one partial

CONFIGS: dict[str, tuple[dict[str, Any], float]] = {
    "q_lora_yarn_bias": ({}, 0.3),
    "no_q_lora": ({"q_lora_rank": None}, 0.3),
    "one_group_top3": ({"n_group": 1, "topk_group": 1, "num_experts_per_tok": 3}, 0.3),
    "groups2_top1group_negative_bias": (
        {"n_group": 2, "topk_group": 1, "num_experts_per_tok": 2, "_bias_negative": True},
        0.6,
    ),
    "mscale_mixed_no_interleave": ({**ROPE_VARIANTS["mscale_mixed"], "rope_interleave": False}, 0.3),
    "mscale_0707_dense_first2": ({**ROPE_VARIANTS["mscale_0707"], "first_k_dense_replace": 2}, 0.3),
    "v32_sparse": (V32_OVERRIDES, 0.3),
}


def compare_prompt(built: BuiltCheckpoint, prompt: list[int], logits: torch.Tensor) -> None:
    """``logits [T, V]`` of ``prompt`` against transformers', up to the indexer cut (V3.2), which
    must lie past the first sparse positions."""
    cut = indexer_cut(built.hf_model, prompt)
    if built.config.get("index_topk") is not None:
        least = min(len(prompt), built.config["index_topk"] + 8)
        assert cut >= least, f"indexer cut at {cut}: too few sparse positions compared"
    compare(hf_logits(built.hf_model, prompt)[:cut], logits[:cut])


def _prompt(n: int, seed: int, vocab: int = 4096) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Runner:
    """Runs a loaded model over one sequence, step by step, on its own paged cache."""

    def __init__(self, loaded: LoadedModel, max_tokens: int = 128) -> None:
        self.model = loaded.model
        num_pages = -(-max_tokens // PAGE)
        self.pool = _pool(loaded, num_pages + 2)
        # a shuffled, non-contiguous page list, as an allocator in use would hand out
        self.pages = torch.randperm(num_pages + 2, generator=torch.Generator().manual_seed(1))[
            :num_pages
        ].tolist()
        self.table = self.pool.block_table([self.pages])

    def batch(self, start: int, end: int, absorbed: bool) -> ForwardBatch:
        return ForwardBatch(
            positions=torch.arange(start, end),
            slot_mapping=self.pool.slots(self.pages, start, end),
            block_tables=self.table,
            q_lens=[end - start],
            kv_lens=[end],
            num_absorbed=int(absorbed),
        )

    def step(self, ids: list[int], start: int, absorbed: bool) -> torch.Tensor:
        """Hidden states of ids placed at positions start.. (the cache holds 0..start-1)."""
        batch = self.batch(start, start + len(ids), absorbed)
        return self.model(torch.tensor(ids), batch, self.pool.caches)


def _pool(loaded: LoadedModel, num_pages: int) -> PagedKVPool:
    return PagedKVPool.for_model(
        loaded.config, loaded.model.num_cache_layers, num_pages, torch.float32, "cpu", page_size=PAGE
    )


def _load(ckpt: BuiltCheckpoint, **kwargs: Any) -> LoadedModel:
    return load_model(ckpt.path, select_ops(torch.device("cpu")), dtype=torch.float32, **kwargs)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> BuiltCheckpoint:
    overrides, bias = CONFIGS[request.param]
    return build_checkpoint(tmp_path_factory.mktemp(request.param), overrides, bias_scale=bias, seed=7)


def test_prefill_logits_match_transformers(built: BuiltCheckpoint) -> None:
    loaded = _load(built)
    prompt = _prompt(40, seed=3)
    runner = Runner(loaded)
    logits = loaded.model.compute_logits(runner.step(prompt, 0, DECOMPRESSED))
    compare_prompt(built, prompt, logits)


def test_absorbed_decode_matches_transformers(built: BuiltCheckpoint) -> None:
    loaded = _load(built)
    prompt = _prompt(40, seed=4)
    runner = Runner(loaded)
    # first 5 tokens by prefill, the remaining 35 one at a time through the absorbed path
    hidden = [runner.step(prompt[:5], 0, DECOMPRESSED)]
    hidden += [runner.step([t], i, ABSORBED) for i, t in enumerate(prompt[5:], start=5)]
    logits = loaded.model.compute_logits(torch.cat(hidden))
    compare_prompt(built, prompt, logits)


def test_chunked_prefill_over_cached_prefix(built: BuiltCheckpoint) -> None:
    """Both paths attend to a prefix already in the cache (chunks of 17 and 2-token absorbed steps)."""
    loaded = _load(built)
    prompt = _prompt(38, seed=5)
    runner = Runner(loaded)
    hidden = [
        runner.step(prompt[:17], 0, DECOMPRESSED),
        runner.step(prompt[17:34], 17, DECOMPRESSED),
    ]
    hidden += [runner.step(prompt[i : i + 2], i, ABSORBED) for i in (34, 36)]
    compare_prompt(built, prompt, loaded.model.compute_logits(torch.cat(hidden)))


def test_absorbed_decodes_of_mixed_lengths_equal_the_decompressed_path(built: BuiltCheckpoint) -> None:
    """Decodes with and without an MTP draft in one step (2, 1 and 3 new tokens): the absorbed
    path left-pads them to one query length and gives what the decompressed path gives."""
    loaded = _load(built)
    pool = _pool(loaded, 12)
    prompts = [_prompt(n, seed=20 + n) for n in (30, 21, 17)]
    pages = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    table = pool.block_table(pages)

    def batch(spans: list[tuple[int, int]], num_absorbed: int) -> ForwardBatch:
        slots = [pool.slots(p, start, end) for p, (start, end) in zip(pages, spans, strict=True)]
        return ForwardBatch(
            positions=torch.cat([torch.arange(start, end) for start, end in spans]),
            slot_mapping=torch.cat(slots),
            block_tables=table,
            q_lens=[end - start for start, end in spans],
            kv_lens=[end for _, end in spans],
            num_absorbed=num_absorbed,
        )

    cached = [len(p) - q for p, q in zip(prompts, (2, 1, 3), strict=True)]
    ids = torch.tensor([t for p, c in zip(prompts, cached, strict=True) for t in p[:c]])
    loaded.model(ids, batch([(0, c) for c in cached], 0), pool.caches)  # the cached prefixes
    step = torch.tensor([t for p, c in zip(prompts, cached, strict=True) for t in p[c:]])
    spans = [(c, len(p)) for p, c in zip(prompts, cached, strict=True)]
    mixed = batch(spans, 3)
    assert mixed.absorbed_padding is not None
    absorbed = loaded.model(step, mixed, pool.caches)
    decompressed = loaded.model(step, batch(spans, 0), pool.caches)
    torch.testing.assert_close(absorbed, decompressed, rtol=1e-4, atol=1e-4)


def test_mtp_layer_matches_reference(built: BuiltCheckpoint) -> None:
    loaded = _load(built)
    assert len(loaded.model.mtp_layers) == 1
    prompt = _prompt(33, seed=6)
    runner = Runner(loaded)
    hidden = runner.step(prompt, 0, DECOMPRESSED)
    torch.testing.assert_close(hidden, hf_last_hidden(built.hf_model, prompt), rtol=1e-4, atol=1e-4)
    # MTP over positions 0..T-2: hidden of t with token t+1
    n = len(prompt) - 1
    batch = runner.batch(0, n, DECOMPRESSED)
    next_tokens = torch.tensor(prompt[1:])
    mtp_hidden = loaded.model.forward_mtp(hidden[:n], next_tokens, batch, runner.pool.caches)
    draft = loaded.model.compute_mtp_logits(mtp_hidden)
    # what a draft reads: the last position alone (attention on the absorbed path over the cache)
    last = loaded.model.forward_mtp(hidden[:n], next_tokens, batch, runner.pool.caches, last_only=True)
    torch.testing.assert_close(last, mtp_hidden[-1:], rtol=1e-4, atol=1e-4)
    # a chained draft's batch (one new token, absorbed) takes no row selection: the same state
    one = runner.batch(n - 1, n, ABSORBED)
    chained = loaded.model.forward_mtp(
        hidden[n - 1 : n], next_tokens[-1:], one, runner.pool.caches, last_only=True
    )
    torch.testing.assert_close(chained, mtp_hidden[-1:], rtol=1e-4, atol=1e-4)
    assert built.mtp_state is not None
    reference = mtp_reference(
        built.hf_model.config, built.mtp_state, hidden[:n], next_tokens, torch.arange(n)
    )
    compare(reference, draft)


def test_fp8_checkpoint_dequantized_matches(tmp_path: Path) -> None:
    built = build_checkpoint(tmp_path / "fp8", FP8_OVERRIDES, fp8=True, bias_scale=0.3, seed=11)
    loaded = _load(built)
    ops_fp8 = loaded.model.lm_head.ops.supports_fp8_gemm
    assert not ops_fp8, "CPU torch ops dequantize FP8 checkpoints at load"
    prompt = _prompt(24, seed=8)
    runner = Runner(loaded)
    prefill = loaded.model.compute_logits(runner.step(prompt[:12], 0, DECOMPRESSED))
    decode = [runner.step([t], i, ABSORBED) for i, t in enumerate(prompt[12:], start=12)]
    logits = torch.cat([prefill, loaded.model.compute_logits(torch.cat(decode))])
    compare(hf_logits(built.hf_model, prompt), logits)


def test_checkpoint_without_mtp_loads_for_decoding(tmp_path: Path) -> None:
    from dsinfer.model.deepseek_v3 import MTPUnavailableError
    from dsinfer.model.loader import CheckpointError

    built = build_checkpoint(tmp_path / "nomtp", with_mtp=False)
    loaded = _load(built)
    assert len(loaded.model.mtp_layers) == 0
    prompt = _prompt(10, seed=9)
    runner = Runner(loaded)
    hidden = runner.step(prompt, 0, DECOMPRESSED)
    compare(hf_logits(built.hf_model, prompt), loaded.model.compute_logits(hidden))
    with pytest.raises(MTPUnavailableError, match="MTP depth 0 is not loaded"):
        loaded.model.forward_mtp(hidden, torch.tensor(prompt), runner.batch(0, 10, DECOMPRESSED), [])
    with pytest.raises(CheckpointError, match=r"1 MTP layer\(s\) requested but the checkpoint has 0"):
        _load(built, num_mtp_layers=1)


def test_fp8_weights_kept_where_ops_run_fp8(tmp_path: Path) -> None:
    """With an FP8-capable ops (the torch reference forced to claim it), FP8 weights and their
    block scales are placed as they are on disk, gate/up stacked per expert."""
    from dataclasses import replace

    from harness.checkpoints import load_tensors

    built = build_checkpoint(
        tmp_path / "fp8k", {**FP8_OVERRIDES, "moe_intermediate_size": 128}, fp8=True, bias_scale=0.3, seed=12
    )
    ops = replace(select_ops(torch.device("cpu")), supports_fp8_gemm=True)
    loaded = load_model(built.path, ops, dtype=torch.float32)
    disk = load_tensors(built.path)
    attn = loaded.model.model.layers[1].self_attn
    assert attn.q_a_proj.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(
        attn.q_a_proj.weight.view(torch.uint8),
        disk["model.layers.1.self_attn.q_a_proj.weight"].view(torch.uint8),
    )
    assert torch.equal(
        attn.q_a_proj.weight_scale_inv, disk["model.layers.1.self_attn.q_a_proj.weight_scale_inv"]
    )
    experts = loaded.model.model.layers[1].mlp.experts
    up = disk["model.layers.1.mlp.experts.5.up_proj.weight"].view(torch.uint8)
    assert torch.equal(experts.w13[5, 128:].view(torch.uint8), up)
    assert torch.equal(
        experts.w13_scale_inv[5, 1:], disk["model.layers.1.mlp.experts.5.up_proj.weight_scale_inv"]
    )
    assert loaded.model.lm_head.weight.dtype == torch.float32  # never FP8 in DeepSeek's checkpoints
    # End to end the activations are quantized 1x128 too (about 2-3% error per GEMM, and a router
    # decision may flip), so the logits follow the dequantized reference only statistically.
    prompt = _prompt(16, seed=13)
    logits = loaded.model.compute_logits(Runner(loaded).step(prompt, 0, DECOMPRESSED))
    cosine = torch.nn.functional.cosine_similarity(logits, hf_logits(built.hf_model, prompt), dim=-1)
    assert cosine.median() > 0.98 and cosine.min() > 0.8, cosine


def test_mixed_batch_of_prefill_chunks_and_decodes(built: BuiltCheckpoint) -> None:
    """One forward holding two prefill chunks (decompressed path) and three decodes (absorbed path)
    gives each sequence the logits it gets alone."""
    loaded = _load(built)
    prompts = [_prompt(n, seed=20 + n) for n in (9, 23, 17, 30, 12)]
    pool = _pool(loaded, 40)
    pages = [pool.allocator.allocate(pool.pages_for(len(p))) for p in prompts]
    # sequences 2..4 have all but their last token cached already
    for p, pg in zip(prompts[2:], pages[2:], strict=True):
        n = len(p) - 1
        prefill = ForwardBatch(torch.arange(n), pool.slots(pg, 0, n), pool.block_table([pg]), [n], [n])
        loaded.model(torch.tensor(p[:n]), prefill, pool.caches)
    starts = [0, 0] + [len(p) - 1 for p in prompts[2:]]
    ids = torch.tensor([t for p, s in zip(prompts, starts, strict=True) for t in p[s:]])
    batch = ForwardBatch(
        positions=torch.cat([torch.arange(s, len(p)) for p, s in zip(prompts, starts, strict=True)]),
        slot_mapping=torch.cat(
            [pool.slots(pg, s, len(p)) for p, pg, s in zip(prompts, pages, starts, strict=True)]
        ),
        block_tables=pool.block_table(pages),
        q_lens=[len(p) - s for p, s in zip(prompts, starts, strict=True)],
        kv_lens=[len(p) for p in prompts],
        num_absorbed=3,
    )
    logits = loaded.model.compute_logits(loaded.model(ids, batch, pool.caches)[batch.last_token_indices()])
    for i, p in enumerate(prompts):
        assert indexer_cut(built.hf_model, p) == len(p)
        compare(hf_logits(built.hf_model, p)[-1], logits[i])


def test_batched_fresh_prefill_matches_transformers(built: BuiltCheckpoint) -> None:
    """Several prompts with no cached prefix in one forward (the padded decompressed path)."""
    loaded = _load(built)
    prompts = [_prompt(n, seed=40 + n) for n in (30, 25, 33, 20)]
    pool = _pool(loaded, 12)
    pages = [pool.allocator.allocate(pool.pages_for(len(p))) for p in prompts]
    batch = ForwardBatch(
        positions=torch.cat([torch.arange(len(p)) for p in prompts]),
        slot_mapping=torch.cat([pool.slots(pg, 0, len(p)) for p, pg in zip(prompts, pages, strict=True)]),
        block_tables=pool.block_table(pages),
        q_lens=[len(p) for p in prompts],
        kv_lens=[len(p) for p in prompts],
    )
    logits = loaded.model.compute_logits(
        loaded.model(torch.tensor([t for p in prompts for t in p]), batch, pool.caches)
    )
    start = 0
    for p in prompts:
        compare_prompt(built, p, logits[start : start + len(p)])
        start += len(p)


def test_v32_fp8_checkpoint_dequantized_matches(tmp_path: Path) -> None:
    """V3.2 shipped as DeepSeek ships it: the indexer's wq_b and wk in FP8 with block scales, its
    head weights and key norm in high precision. Dequantized on CPU, the logits are the reference's."""
    from harness.checkpoints import load_tensors

    built = build_checkpoint(tmp_path / "v32fp8", {**FP8_OVERRIDES, **V32_OVERRIDES}, fp8=True, seed=13)
    disk = load_tensors(built.path)
    prefix = "model.layers.1.self_attn.indexer."
    assert (
        disk[prefix + "wq_b.weight"].dtype == torch.float8_e4m3fn and prefix + "wk.weight_scale_inv" in disk
    )
    assert disk[prefix + "weights_proj.weight"].dtype == torch.float32 and prefix + "k_norm.bias" in disk
    loaded = _load(built)
    prompt = _prompt(30, seed=14)
    runner = Runner(loaded)
    prefill = loaded.model.compute_logits(runner.step(prompt[:20], 0, DECOMPRESSED))
    decode = [runner.step([t], i, ABSORBED) for i, t in enumerate(prompt[20:], start=20)]
    compare_prompt(built, prompt, torch.cat([prefill, loaded.model.compute_logits(torch.cat(decode))]))


def test_v32_fp8_indexer_cache_follows_statistically(tmp_path: Path) -> None:
    """The release's FP8 indexer cache (Hadamard-rotated e4m3 keys and queries, per-key scales):
    keys land in the uint8 page layout; the first layer, whose input is the same either way, picks
    mostly the keys the unquantised indexer picks (FP8 moves near-ties), and the logits follow the
    reference statistically (a random tiny model amplifies every changed pick through the layers)."""
    from dataclasses import replace

    built = build_checkpoint(tmp_path / "v32", V32_OVERRIDES, bias_scale=0.3, seed=7)
    loaded = _load(built)
    first = loaded.model.model.layers[0].self_attn.indexer
    assert first is not None
    picks: list[torch.Tensor] = []

    def recording(*args: Any) -> torch.Tensor:
        picks.append(first_ops.indexer_topk(*args))
        return picks[-1]

    first_ops = first.ops
    first.ops = replace(first_ops, indexer_topk=recording)
    prompt = _prompt(120, seed=15)
    logits = {}
    for fmt in ("model", "fp8"):
        runner = Runner(loaded)
        runner.pool = PagedKVPool.for_model(
            loaded.config,
            loaded.model.num_cache_layers,
            runner.pool.num_pages,
            torch.float32,
            "cpu",
            fmt,
            PAGE,
        )
        logits[fmt] = loaded.model.compute_logits(runner.step(prompt, 0, DECOMPRESSED))
    first.ops = first_ops
    assert runner.pool.caches[0].indexer is not None and runner.pool.caches[0].indexer.dtype == torch.uint8
    plain, fp8 = picks[0][0, 12:], picks[1][0, 12:]  # the sparse positions of the prompt
    same = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(plain, fp8, strict=True))
    assert same > 0.9 * plain.numel(), same / plain.numel()
    reference = hf_logits(built.hf_model, prompt)
    compare(reference[:12], logits["fp8"][:12])  # dense positions: every key is picked either way
    cosine = torch.nn.functional.cosine_similarity(logits["fp8"], reference, dim=-1)
    assert cosine.median() > 0.8, cosine


def test_v32_prefill_scores_long_chunks_block_by_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prefill chunk's indexer logits are computed in blocks of queries within a memory budget;
    blocks of one and of three queries pick what the whole chunk at once picks."""
    import dsinfer.model.indexer as indexer_module

    built = build_checkpoint(tmp_path / "v32", V32_OVERRIDES, bias_scale=0.3, seed=7)
    loaded = _load(built)
    prompt = _prompt(50, seed=16)
    whole = loaded.model.compute_logits(Runner(loaded).step(prompt, 0, DECOMPRESSED))
    for rows in (1, 3):
        monkeypatch.setattr(indexer_module, "LOGITS_BUDGET", rows * (128 // PAGE + 2) * PAGE)
        blocked = loaded.model.compute_logits(Runner(loaded).step(prompt, 0, DECOMPRESSED))
        torch.testing.assert_close(blocked, whole, rtol=1e-6, atol=1e-6)
