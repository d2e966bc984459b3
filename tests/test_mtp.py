"""MTP speculative decoding: the same tokens as without it, and real speed-up when the MTP layer
predicts well."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsinfer import LLM, SamplingParams
from harness.checkpoints import BuiltCheckpoint, agreeing_mtp_checkpoint
from harness.hf_reference import compare_tokens, hf_greedy_steps

pytestmark = pytest.mark.system


def _prompts(count: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(2, 4096, (int(torch.randint(2, 90, (1,), generator=g)),), generator=g).tolist()
        for _ in range(count)
    ]


def _llm(path: Path, mtp: bool, steps: int = 1, by_batch: str = "", draft_dtype: str = "auto") -> LLM:
    return LLM(
        str(path),
        dtype="float32",
        kv_cache_memory="16MiB",
        max_num_batched_tokens=64,
        speculative_mtp=mtp,
        speculative_num_steps=steps,
        speculative_steps_by_batch=by_batch,
        speculative_draft_dtype=draft_dtype,
    )


def _tokens(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_mtp_gives_the_same_tokens(tiny_ckpt: BuiltCheckpoint) -> None:
    prompts = _prompts(16, seed=1)
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 8 + [
        SamplingParams(temperature=0.8, top_k=40, seed=i, max_tokens=12, ignore_eos=True) for i in range(8)
    ]
    off, on = _llm(tiny_ckpt.path, False), _llm(tiny_ckpt.path, True)
    assert _tokens(on, prompts, params) == _tokens(off, prompts, params)
    stats = on.engine.scheduler.stats
    assert stats.drafts_proposed > 0
    assert on.engine.kv.num_available_pages() == on.engine.kv.num_pages


def test_asking_mtp_of_a_checkpoint_without_it_fails_clearly(tmp_path: Path) -> None:
    from dsinfer.model.loader import CheckpointError
    from harness.checkpoints import build_checkpoint

    built = build_checkpoint(tmp_path / "nomtp", with_mtp=False)
    with pytest.raises(CheckpointError, match="MTP layer"):
        _llm(built.path, True)


def test_agreeing_mtp_layer_accepts_most_drafts(tiny_ckpt: BuiltCheckpoint, tmp_path: Path) -> None:
    path = agreeing_mtp_checkpoint(tiny_ckpt, tmp_path / "bigram")
    prompts = _prompts(8, seed=2)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)]
    on = _llm(path, True)
    got = _tokens(on, prompts, params * len(prompts))
    assert got == _tokens(_llm(path, False), prompts, params * len(prompts))
    stats = on.engine.scheduler.stats
    assert stats.acceptance_rate > 0.5, stats
    assert stats.forwards_per_output_token < 1, stats
    # and the bigram model itself is what transformers computes from the same files
    from transformers import DeepseekV3ForCausalLM

    reference = DeepseekV3ForCausalLM.from_pretrained(str(path)).eval()
    ref, ref_logits = hf_greedy_steps(reference, prompts[0], 24, eos_ids=())
    compare_tokens(ref, got[0], ref_logits)


def test_chained_drafts_give_the_same_tokens(tiny_ckpt: BuiltCheckpoint) -> None:
    """Three drafts a step from a random MTP layer (most rejected, at any depth): the same tokens,
    greedy and seeded, also where max_tokens leaves room for fewer drafts; every page freed."""
    prompts = _prompts(12, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=1 + i, ignore_eos=True) for i in range(6)] + [
        SamplingParams(temperature=0.8, top_k=40, seed=i, max_tokens=3 + 2 * i, ignore_eos=True)
        for i in range(6)
    ]
    on = _llm(tiny_ckpt.path, True, steps=3)
    assert _tokens(on, prompts, params) == _tokens(_llm(tiny_ckpt.path, False), prompts, params)
    assert on.engine.scheduler.stats.drafts_proposed > 0
    assert on.engine.kv.num_available_pages() == on.engine.kv.num_pages


def test_chained_drafts_of_an_agreeing_layer_are_accepted(tiny_ckpt: BuiltCheckpoint, tmp_path: Path) -> None:
    """An MTP layer whose drafts agree at any depth: three drafts a step, nearly all accepted, so a
    verification yields about four tokens, and they are those of decoding without MTP."""
    path = agreeing_mtp_checkpoint(tiny_ckpt, tmp_path / "bigram")
    prompts = _prompts(6, seed=4)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * len(prompts)
    on = _llm(path, True, steps=3)
    assert _tokens(on, prompts, params) == _tokens(_llm(path, False), prompts, params)
    stats = on.engine.scheduler.stats
    assert stats.drafts_proposed > 2 * stats.draft_verifications, stats  # mostly three drafts a step
    assert stats.acceptance_rate > 0.9, stats
    assert stats.mean_accepted_length > 3.5, stats
    assert stats.forwards_per_output_token < 0.35, stats
    assert on.engine.kv.num_available_pages() == on.engine.kv.num_pages


def test_drafts_in_bfloat16_give_float32s_tokens(tiny_ckpt: BuiltCheckpoint, tmp_path: Path) -> None:
    """``speculative_draft_dtype="bfloat16"`` under a float32 target: the MTP layer's weights (not
    its router's) in bf16, the target's untouched; three drafts a step, greedy and seeded, give
    plain float32 decoding's tokens, nearly all accepted; every page freed."""
    from dsinfer.engine.device import model_identity

    path = agreeing_mtp_checkpoint(tiny_ckpt, tmp_path / "bigram")
    prompts = _prompts(8, seed=6)
    greedy = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * 8
    on, off = _llm(path, True, steps=3, draft_dtype="bfloat16"), _llm(path, False)
    assert _tokens(on, prompts, greedy) == _tokens(off, prompts, greedy)
    stats = on.engine.scheduler.stats
    assert stats.acceptance_rate > 0.9, stats  # (float32 drafts: all accepted)
    assert stats.mean_accepted_length > 3.5, stats
    # seeded (this layer's drafts are seldom drawn at temperature 0.8, in float32 as well)
    seeded = [
        SamplingParams(temperature=0.8, top_k=40, seed=i, max_tokens=30, ignore_eos=True) for i in range(8)
    ]
    assert _tokens(on, prompts, seeded) == _tokens(off, prompts, seeded)
    assert on.engine.kv.num_available_pages() == on.engine.kv.num_pages
    model = on.engine.model
    layer = model.mtp_layers[0]
    assert layer.draft_dtype == torch.bfloat16
    assert layer.eh_proj.weight.dtype == layer.shared_head.head.weight.dtype == torch.bfloat16
    assert layer.self_attn.w_uk.dtype == layer.mlp.experts.w13.dtype == torch.bfloat16
    assert layer.mlp.gate.weight.dtype == torch.float32
    assert model.lm_head.weight.dtype == model.model.layers[1].self_attn.w_uk.dtype == torch.float32
    # KV written beside a bf16 draft layer is not another engine's (prefix cache, PD peers)
    cpu = torch.device("cpu")
    assert model_identity(path, "safetensors", 0, torch.float32, cpu, torch.bfloat16) != model_identity(
        path, "safetensors", 0, torch.float32, cpu
    )


def test_a_prompts_last_chunk_drafts_as_far_as_max_tokens_leaves_room(
    tiny_ckpt: BuiltCheckpoint, tmp_path: Path
) -> None:
    """With three drafts a step the chunk that ends a prompt chains drafts too, as many as its
    max_tokens leaves room to verify: one decode step then finishes each request (its pages, the
    chained latent's included, are all freed), with plain decoding's tokens."""
    path = agreeing_mtp_checkpoint(tiny_ckpt, tmp_path / "bigram")
    on, off = _llm(path, True, steps=3), _llm(path, False)
    stats = on.engine.scheduler.stats
    for max_tokens, drafts in ((3, 1), (4, 2), (5, 3)):
        params = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)]
        prompts = _prompts(1, seed=10 + max_tokens)
        before = (stats.drafts_proposed, stats.draft_verifications)
        assert _tokens(on, prompts, params) == _tokens(off, prompts, params)
        assert (stats.drafts_proposed - before[0], stats.draft_verifications - before[1]) == (drafts, 1)
        assert on.engine.kv.num_available_pages() == on.engine.kv.num_pages


def test_fewer_drafts_at_larger_batches(tiny_ckpt: BuiltCheckpoint, tmp_path: Path) -> None:
    """``speculative_steps_by_batch="4:1"`` with three drafts a step: a lone request verifies
    about three drafts a step, six at once one draft a step (three again once fewer than four are
    left); plain decoding's tokens either way, every page freed."""
    path = agreeing_mtp_checkpoint(tiny_ckpt, tmp_path / "bigram")
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = _prompts(6, seed=5)
    off, on = _llm(path, False), _llm(path, True, steps=3, by_batch="4:1")
    stats = on.engine.scheduler.stats
    assert _tokens(on, prompts[:1], [params]) == _tokens(off, prompts[:1], [params])
    assert stats.drafts_proposed > 2.5 * stats.draft_verifications, stats
    lone = (stats.drafts_proposed, stats.draft_verifications)
    assert _tokens(on, prompts, [params] * 6) == _tokens(off, prompts, [params] * 6)
    drafts, verifications = stats.drafts_proposed - lone[0], stats.draft_verifications - lone[1]
    assert verifications > 0 and drafts < 1.5 * verifications, stats
    assert stats.acceptance_rate > 0.9, stats
    assert on.engine.kv.num_available_pages() == on.engine.kv.num_pages


def test_drafts_by_batch_size() -> None:
    from dsinfer.engine.args import parse_steps_by_batch, steps_at

    schedule = parse_steps_by_batch("16:3, 64:1")
    assert schedule == ((16, 3), (64, 1)) and parse_steps_by_batch("") == ()
    assert [steps_at(5, schedule, n) for n in (1, 15, 16, 63, 64, 256)] == [5, 5, 3, 3, 1, 1]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"speculative_mtp": True, "speculative_num_steps": 0}, "speculative_num_steps must be at least 1"),
        ({"speculative_num_steps": 2}, "add --speculative-mtp"),
        ({"speculative_steps_by_batch": "16:1"}, "add --speculative-mtp"),
        ({"speculative_mtp": True, "speculative_steps_by_batch": "16"}, "as BATCH:DRAFTS"),
        ({"speculative_mtp": True, "speculative_steps_by_batch": "16:x"}, "as BATCH:DRAFTS"),
        ({"speculative_mtp": True, "speculative_num_steps": 3, "speculative_steps_by_batch": "16:4"},
         r"from 1 to speculative_num_steps \(3\); got \[4\]"),
        ({"speculative_mtp": True, "speculative_num_steps": 3, "speculative_steps_by_batch": "16:2,8:1"},
         r"increasing; got \[16, 8\]"),
        ({"speculative_mtp": True, "speculative_num_steps": 3, "speculative_steps_by_batch": "1:2"},
         "batch sizes from 2 up"),
        ({"speculative_draft_dtype": "bfloat16"}, "add --speculative-mtp"),
        ({"speculative_mtp": True, "speculative_draft_dtype": "fp8"},
         "speculative_draft_dtype must be auto, float32, bfloat16 or float16, got 'fp8'"),
    ],
)  # fmt: skip
def test_bad_speculative_num_steps_fail_clearly(kwargs: dict[str, object], message: str) -> None:
    from dsinfer.engine.args import EngineArgs

    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)  # type: ignore[arg-type]


def test_chained_drafts_in_an_expert_parallel_pool_fail_clearly(tiny_ckpt: BuiltCheckpoint) -> None:
    """Refused before the model loads: each chained draft would be a collective forward."""
    from dsinfer.engine.args import EngineArgs
    from dsinfer.engine.engine import LLMEngine

    args = EngineArgs(model=str(tiny_ckpt.path), speculative_mtp=True, speculative_num_steps=2)
    with pytest.raises(ValueError, match="expert-parallel pool"):
        LLMEngine(args, ep_group=object())  # type: ignore[arg-type]


def test_a_draft_dtype_of_its_own_in_an_expert_parallel_pool_fails_clearly(
    tiny_ckpt: BuiltCheckpoint,
) -> None:
    """Refused before the model loads: EPLB moves the MTP layer's experts in the model's dtype."""
    from dsinfer.engine.args import EngineArgs
    from dsinfer.engine.engine import LLMEngine

    args = EngineArgs(
        model=str(tiny_ckpt.path), dtype="float32", speculative_mtp=True, speculative_draft_dtype="bfloat16"
    )
    with pytest.raises(ValueError, match="speculative_draft_dtype other than the model's"):
        LLMEngine(args, ep_group=object())  # type: ignore[arg-type]
