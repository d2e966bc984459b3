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


def _llm(path: Path, mtp: bool) -> LLM:
    return LLM(
        str(path), dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=64, speculative_mtp=mtp
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
