"""DeepSeek-V4 on a GPU (skipped without one; the lease's ``gpu-tests`` stage runs them): the tiny
checkpoints through the backends the ops choose on CUDA (the Triton kernels for the compressor's
pooling, the sparse attention core with its sink and the indexer; the MXFP4 grouped GEMM over the
release's packed experts and the FP8 GEMMs of its linear layers) against the CPU reference, and
the engine with MTP on the GPU. Nothing here has run on a GPU yet (written 2026-11-28 without one)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsinfer.base.sampling_params import SamplingParams
from dsinfer.engine.llm import LLM
from dsinfer.model.v4_loader import load_v4
from dsinfer.ops import select_ops
from harness.v4_checkpoints import CONFIGS, add_v4_mtp, build_v4

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("transformers")


def _prompt(n: int) -> torch.Tensor:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(n))


def _agree(got: torch.Tensor, expected: torch.Tensor, median: float, least: float) -> None:
    cosine = torch.nn.functional.cosine_similarity(got.float().cpu(), expected.float(), dim=-1)
    assert cosine.median() > median and cosine.min() > least, cosine
    same = (got.cpu().argmax(-1) == expected.argmax(-1)).float().mean()
    assert same > 0.9, same


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_v4_forward_on_gpu_follows_the_cpu(name: str, tmp_path: Path) -> None:
    build_v4(name, tmp_path)
    cpu = load_v4(tmp_path, select_ops("cpu", "torch"))
    ops = select_ops("cuda")
    assert ops.backends["v4_compress"] == "triton", ops.backends
    assert ops.backends["sparse_mla"] in ("triton", "flashmla") and ops.backends["indexer"] != "torch"
    gpu = load_v4(tmp_path, ops).to("cuda")
    ids = _prompt(300)
    expected = cpu.compute_logits(cpu(ids, cpu.new_state()))
    # float32 weights: tensor cores may round the kernels' products to tf32
    _agree(gpu.compute_logits(gpu(ids.cuda(), gpu.new_state())), expected, 0.999, 0.99)


def test_release_weights_on_gpu(tmp_path: Path) -> None:
    """FP8 linear layers and packed MXFP4 experts, as the release ships them, run as such."""
    from tests.test_v4_model import _release_quantized

    build_v4("flash_like", tmp_path / "hf")
    _release_quantized(tmp_path / "hf", tmp_path / "release", tmp_path / "dequantized")
    reference = load_v4(tmp_path / "dequantized", select_ops("cpu", "torch"))
    ops = select_ops("cuda")
    model = load_v4(tmp_path / "release", ops).to("cuda")
    moe = model.layers[3].ffn
    assert moe.mxfp4 and ops.backends["mxfp4"] != "torch", ops.backends
    assert model.layers[0].attn.wq_a.weight.dtype == torch.float8_e4m3fn
    ids = _prompt(120)
    expected = reference.compute_logits(reference(ids, reference.new_state()))
    # activations are quantized to FP8 in the linear layers: the logits follow statistically
    _agree(model.compute_logits(model(ids.cuda(), model.new_state())), expected, 0.98, 0.8)


def test_mtp_on_gpu_keeps_the_tokens(tmp_path: Path) -> None:
    """A nearly-bigram checkpoint (attention scaled down, FFN outputs zero) whose MTP layer computes
    the bigram: drafts are mostly accepted, and decoding with them gives decoding's tokens."""
    build_v4("flash_like", tmp_path, with_tokenizer=True)
    add_v4_mtp(tmp_path, 0.0)
    prompts = [_prompt(n).add(2).tolist() for n in (20, 150, 300)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def tokens(llm: LLM) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    plain = LLM(str(tmp_path), device="cuda", dtype="float32")
    mtp = LLM(str(tmp_path), device="cuda", dtype="float32", speculative_mtp=True)
    assert tokens(mtp) == tokens(plain)
    stats = mtp.engine.scheduler.stats
    assert stats.drafts_accepted > 0.8 * stats.drafts_proposed, stats
