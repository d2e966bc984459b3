"""DeepSeek-V4's MTP layer (the release's ``mtp.0.*``; transformers keeps none): read when asked
for and passed over otherwise; a rejected draft's token taken back out of the hybrid state exactly
(window, unfinished compressor rows, CSA's overlap, entry counts); and the identity MTP promises:
the engine's tokens with MTP equal its tokens without, and transformers', greedy and seeded,
whether the drafts are rejected, accepted or some of each (harness/v4_checkpoints.py
``add_v4_mtp``: random weights, or a nearly-bigram model whose MTP layer computes the bigram)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dsinfer.base.sampling_params import SamplingParams
from dsinfer.cache.v4_pool import V4StatePool
from dsinfer.engine.llm import LLM
from dsinfer.model.deepseek_v4 import DeepseekV4ForCausalLM
from dsinfer.model.v4_loader import load_v4
from dsinfer.model.v4_state import SequenceState
from dsinfer.ops import select_ops
from harness.metrics import metric_value
from harness.server import serve
from harness.v4_checkpoints import CONFIGS, TOKENIZER_VOCAB, add_v4_mtp, build_v4, greedy_reference

transformers = pytest.importorskip("transformers")

LENGTHS = (8, 37, 130, 400)
OUTPUT = 16
GREEDY = SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=OUTPUT, ignore_eos=True)


def _checkpoint(tmp_path_factory: pytest.TempPathFactory, name: str, scale: float | None) -> Path:
    directory = tmp_path_factory.mktemp(f"v4_mtp_{name}")
    build_v4(name, directory, with_tokenizer=True)
    add_v4_mtp(directory, scale)
    return directory


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(2, TOKENIZER_VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def _tokens(llm: LLM, params: SamplingParams, prompts: list[list[int]] | None = None) -> list[list[int]]:
    outs = llm.generate(prompts or _prompts(), params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outs]


def _state_parts(state: SequenceState) -> list[torch.Tensor]:
    parts: list[torch.Tensor] = []
    for layer in state.layers:
        parts.append(layer.window)
        for series in (layer.compressed, layer.indexer):
            if series is not None:
                parts += [series.entries.read(), series.pending_kv, series.pending_gate]
                parts += [t for t in (series.overlap_kv, series.overlap_gate) if t is not None]
    return parts


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_rejected_token_taken_back_exactly(name: str, tmp_path: Path) -> None:
    """Fed n tokens then two with an undo record, less the last: the state equals one fed n + 1
    tokens, part for part, for every n around the window (8/12) and the blocks (4, 8/16)."""
    build_v4(name, tmp_path, with_tokenizer=False)
    model = load_v4(tmp_path, select_ops("cpu", "torch"))
    ids = torch.randint(0, 320, (60,), generator=torch.Generator().manual_seed(3))
    for n in range(1, 40):
        verified = model.new_state()
        model(ids[:n], verified)
        streams = model.forward_streams(ids[n : n + 2], [verified], [2], undo=[True])
        model.finish(streams, [verified], [2])
        model.drop_last(verified)
        plain = model.new_state()
        model(ids[: n + 1], plain)
        assert verified.length == plain.length == n + 1
        for ours, theirs in zip(_state_parts(verified), _state_parts(plain), strict=True):
            torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
        next_ours = model.compute_logits(model(ids[n + 1 : n + 2], verified))
        next_theirs = model.compute_logits(model(ids[n + 1 : n + 2], plain))
        torch.testing.assert_close(next_ours, next_theirs, atol=1e-5, rtol=1e-5)


def test_mtp_layer_read_when_asked_for(tmp_path: Path) -> None:
    """The release's names (experts one by one, ``hc_*_fn``) land on the MTP layer; without MTP the
    ``mtp.*`` tensors are passed over and the model is the same."""
    build_v4("flash_like", tmp_path, with_tokenizer=False)
    add_v4_mtp(tmp_path)
    ops = select_ops("cpu", "torch")
    plain = load_v4(tmp_path, ops)
    assert len(plain.mtp) == 0
    model = load_v4(tmp_path, ops, num_mtp_layers=1)
    assert isinstance(model, DeepseekV4ForCausalLM) and len(model.mtp) == 1
    saved = load_file(str(tmp_path / "model.safetensors"))
    layer, inner = model.mtp[0], model.config.moe_intermediate_size
    torch.testing.assert_close(layer.e_proj.weight, saved["mtp.0.e_proj.weight"])
    torch.testing.assert_close(layer.attn_hc.fn, saved["mtp.0.hc_attn_fn"])
    torch.testing.assert_close(layer.hc_head.fn, saved["mtp.0.hc_head_fn"])
    torch.testing.assert_close(layer.ffn.w13[1, inner:], saved["mtp.0.ffn.experts.1.w3.weight"])
    assert not layer.ffn.gate.hashed and layer.attn.compressor is None  # routed; its window only
    torch.testing.assert_close(plain.head.weight, model.head.weight)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize(("scale", "accepted"), [(None, "none"), (0.3, "some"), (0.0, "all")])
def test_mtp_output_equals_plain_and_transformers(
    name: str, scale: float | None, accepted: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    directory = _checkpoint(tmp_path_factory, name, scale)
    reference = transformers.DeepseekV4ForCausalLM.from_pretrained(directory).eval()
    expected = [greedy_reference(reference, prompt, OUTPUT) for prompt in _prompts()]
    plain = LLM(str(directory), dtype="float32", max_num_batched_tokens=96, max_num_seqs=4)
    mtp = LLM(
        str(directory), dtype="float32", max_num_batched_tokens=96, max_num_seqs=4, speculative_mtp=True
    )
    assert _tokens(mtp, GREEDY) == expected == _tokens(plain, GREEDY)
    stats = mtp.engine.scheduler.stats
    assert stats.drafts_proposed > 0
    assert {
        "none": stats.drafts_accepted == 0,
        "some": 0 < stats.drafts_accepted < stats.drafts_proposed,
        "all": stats.drafts_accepted == stats.drafts_proposed,
    }[accepted], stats
    assert _tokens(mtp, SEEDED) == _tokens(plain, SEEDED)
    kv = mtp.engine.kv
    assert len(kv.pool.caches) == 0 and kv.num_available_pages() == kv.num_pages


def test_mtp_through_prefix_hits_and_preemption(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A conversation's next turn resumes at a cached page (its resume point carries the MTP
    layer's window), and a pool of three pages preempts sequences that grow past their first page:
    tokens equal those without MTP."""
    directory = _checkpoint(tmp_path_factory, "flash_like", 0.3)
    first = _prompts()[3]
    turns = [first, first + _prompts()[1]]
    plain = LLM(str(directory), dtype="float32", max_num_batched_tokens=96)
    expected = [_tokens(plain, GREEDY, [turn])[0] for turn in turns]
    mtp = LLM(str(directory), dtype="float32", max_num_batched_tokens=96, speculative_mtp=True)
    assert [_tokens(mtp, GREEDY, [turn])[0] for turn in turns] == expected
    assert mtp.engine.scheduler.stats.drafts_accepted > 0
    assert mtp.engine.kv.stats.memory_hit_tokens >= 256
    page = mtp.engine.kv.pool.page_bytes
    small = LLM(
        str(directory),
        dtype="float32",
        max_num_batched_tokens=96,
        max_num_seqs=4,
        speculative_mtp=True,
        kv_cache_memory=3 * page + V4StatePool.reserve_bytes_for(mtp.engine.config, torch.float32, 4, 1),
    )
    g = torch.Generator().manual_seed(11)
    crossing = [torch.randint(2, TOKENIZER_VOCAB, (n,), generator=g).tolist() for n in (250, 245, 240, 252)]
    assert _tokens(small, GREEDY, crossing) == _tokens(plain, GREEDY, crossing)
    assert small.engine.kv.num_pages == 3 and small.engine.scheduler.stats.preemptions > 0


@pytest.mark.system
@pytest.mark.parametrize("mode", ["pd", "colocated"])
def test_serve_with_mtp_equals_plain(
    mode: str, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """`dsinfer serve --speculative-mtp` on V4, PD (the decode rank resumes from the handed-over
    point, the MTP layer's window in it, and the prefill rank's first draft) or colocated: the
    engine's tokens without MTP, and the drafts' mean accepted length in /metrics."""
    directory = _checkpoint(tmp_path_factory, "flash_like", 0.3)
    plain = LLM(str(directory), dtype="float32", max_num_batched_tokens=96)
    expected = _tokens(plain, GREEDY)
    flags = ["--colocated"] if mode == "colocated" else []
    args = ["--model", str(directory), "--dtype", "float32", "--speculative-mtp", *flags]
    with serve(args, tmp_path) as server:
        client = server.openai_client()
        for prompt, want in zip(_prompts(), expected, strict=True):
            done = client.completions.create(
                model=directory.name,
                prompt=prompt,
                max_tokens=OUTPUT,
                temperature=0,
                logprobs=0,
                extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
            )
            assert [int(t.removeprefix("token_id:")) for t in done.choices[0].logprobs.tokens] == want
        accepted = metric_value(server.metrics(), "dsinfer_spec_decode_mean_accepted_length")
        assert 1.0 < accepted < 2.0


@pytest.mark.system
@pytest.mark.parametrize("overlap", [False, True], ids=["one", "two_micro_batches"])
def test_expert_parallel_pool_with_mtp_equals_plain(
    overlap: bool, tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """A 2-rank pool: the MTP layer's experts spread over the ranks like every layer's; a rank
    without sequences joins its exchanges too; with two micro-batches per step the verification's
    undo records and the last streams come from both. Tokens equal those of one rank without MTP."""
    from tests.test_ep import run_pool

    directory = _checkpoint(tmp_path_factory, "flash_like", 0.3)
    prompts = [p[:40] for p in _prompts()[2:]] * 2 if overlap else _prompts()
    extra = {"enable_overlap": True, "overlap_min_tokens": 1} if overlap else {}
    extra |= {"max_num_seqs": 8, "kv_cache_memory": "16MiB"}
    results = run_pool(directory, 2, tmp_path, prompts, max_tokens=OUTPUT, speculative_mtp=True, **extra)
    plain = LLM(str(directory), dtype="float32", max_num_batched_tokens=96)
    tokens = {rid: t for r in results for rid, t in r["tokens"].items()}
    stop_at_eos = SamplingParams(temperature=0, max_tokens=OUTPUT)  # as the ranks run them
    assert tokens == {f"p{i}": t for i, t in enumerate(_tokens(plain, stop_at_eos, prompts))}
    assert sum(r["drafts"][1] for r in results) > 0
    if overlap:
        assert all(r["two_micro_batch_steps"]["decode"] > 0 for r in results)
    assert all(r["free_pages_ok"] for r in results)


def test_mtp_through_the_disk_tier_after_a_restart(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """Pages written by an engine with MTP carry the MTP layer's window in their resume points: an
    engine started afterwards hits them from disk and answers as one without MTP; the files of an
    engine without MTP have another page layout and are not read by one with it."""
    directory = _checkpoint(tmp_path_factory, "flash_like", 0.3)
    g = torch.Generator().manual_seed(5)
    first = torch.randint(2, TOKENIZER_VOCAB, (600,), generator=g).tolist()
    branch = first[:560] + torch.randint(2, TOKENIZER_VOCAB, (90,), generator=g).tolist()
    plain = LLM(str(directory), dtype="float32", max_num_batched_tokens=96)
    expected = _tokens(plain, GREEDY, [branch])

    def engine(kv: Path, mtp: bool) -> LLM:
        return LLM(
            str(directory),
            dtype="float32",
            max_num_batched_tokens=96,
            kv_disk_cache_dir=str(kv),
            speculative_mtp=mtp,
        )

    writer = engine(tmp_path / "mtp", True)
    _tokens(writer, GREEDY, [first])
    writer.engine.kv.flush()
    assert writer.engine.kv.stats.disk_pages_written == 2
    reader = engine(tmp_path / "mtp", True)
    assert _tokens(reader, GREEDY, [branch]) == expected
    assert reader.engine.kv.stats.disk_hit_tokens == 512
    other = engine(tmp_path / "plain", False)
    _tokens(other, GREEDY, [first])
    other.engine.kv.flush()
    mixed = engine(tmp_path / "plain", True)
    assert _tokens(mixed, GREEDY, [branch]) == expected
    assert mixed.engine.kv.stats.disk_hit_tokens == 0


def test_an_mtp_layer_in_a_dtype_of_its_own_is_refused_clearly(tmp_path: Path) -> None:
    """``speculative_draft_dtype`` is a V3-family option: V4's MTP layer is refused before it loads."""
    from dsinfer.model.loader import CheckpointError

    build_v4("flash_like", tmp_path, with_tokenizer=True)
    add_v4_mtp(tmp_path)
    with pytest.raises(CheckpointError, match="an MTP layer in a dtype other than the model's is not served"):
        LLM(str(tmp_path), dtype="float32", speculative_mtp=True, speculative_draft_dtype="bfloat16")
