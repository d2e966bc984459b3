"""The decode step over static buffers, padded to batch-size buckets (dsinfer/engine/cuda_graph.py).

On CPU the runner's ``capture=False`` mode runs the very callable a CUDA graph captures (static
buffers, padding rows on the dummy page, masked experts); the GPU test captures and replays."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dsinfer import LLM, SamplingParams
from dsinfer.base.kv_spec import KVCacheSpec
from dsinfer.cache.kv_pool import PagedKVPool
from dsinfer.engine.cuda_graph import CudaGraphRunner, DecodeRows, graph_batch_sizes, graph_unsupported_reason
from dsinfer.model.batch import ForwardBatch
from dsinfer.model.loader import load_model
from dsinfer.model.moe import MoE
from dsinfer.ops import select_ops
from harness.checkpoints import BuiltCheckpoint, agreeing_mtp_checkpoint
from harness.hf_reference import compare, hf_logits
from tests.test_engine import make_llm

PAGE = 16


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 4096, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_batch_size_buckets() -> None:
    assert graph_batch_sizes(1) == (1,)
    assert graph_batch_sizes(20) == (1, 2, 4, 8, 16, 20)
    big = graph_batch_sizes(300)
    assert big[:6] == (1, 2, 4, 8, 16, 24) and big[-4:] == (256, 272, 288, 300)
    assert all(b % 8 == 0 for b in big[3:-1])


def test_expert_parallel_and_cpu_capture_are_refused() -> None:
    ep_model: Any = SimpleNamespace(ep=object())
    reason = graph_unsupported_reason(ep_model)
    assert reason is not None and "expert parallelism" in reason
    pool = PagedKVPool(1, 4, KVCacheSpec.latent(8, "float32", PAGE))
    with pytest.raises(ValueError, match="expert parallelism"):
        CudaGraphRunner(ep_model, pool, max_batch_size=4, max_seq_len=64, capture=False)
    plain_model: Any = SimpleNamespace(ep=None)
    with pytest.raises(ValueError, match="CUDA device"):
        CudaGraphRunner(plain_model, pool, max_batch_size=4, max_seq_len=64)


def _moe_load(model: torch.nn.Module) -> int:
    return sum(int(m.expert_load.sum()) for m in model.modules() if isinstance(m, MoE))


def _prefill(
    model: torch.nn.Module, pool: PagedKVPool, prompts: list[list[int]], pages: list[list[int]]
) -> tuple[list[int], torch.Tensor, ForwardBatch]:
    """All but the last token of every prompt through the ordinary (decompressed) prefill:
    (the lengths prefilled, the hidden states, the batch)."""
    lens = [len(p) - 1 for p in prompts]
    prefill = ForwardBatch(
        positions=torch.cat([torch.arange(n) for n in lens]),
        slot_mapping=torch.cat([pool.slots(pg, 0, n) for pg, n in zip(pages, lens, strict=True)]),
        block_tables=pool.block_table(pages),
        q_lens=lens,
        kv_lens=lens,
    )
    return lens, model(torch.tensor([t for p in prompts for t in p[:-1]]), prefill, pool.caches), prefill


@pytest.mark.parametrize("checkpoint", ["tiny_ckpt", "tiny_ckpt_v32"])
def test_padded_static_decode_matches_transformers(checkpoint: str, request: pytest.FixtureRequest) -> None:
    """Two decode steps through the graph callable (5 sequences in bucket 8, then 3 in bucket 4):
    logits match transformers, only the new tokens' slots and the dummy page are written (in
    every cache: V3.2's indexer keys too), and padding rows count no expert load. V3.2's decode
    runs the indexer and sparse MLA over the static block tables (12 keys of up to 31)."""
    tiny_ckpt: BuiltCheckpoint = request.getfixturevalue(checkpoint)
    loaded = load_model(tiny_ckpt.path, select_ops("cpu"), dtype=torch.float32)
    model, config = loaded.model, loaded.config
    pool = PagedKVPool.for_model(config, model.num_cache_layers, 24, torch.float32, "cpu", page_size=PAGE)
    graphs = CudaGraphRunner(model, pool, max_batch_size=8, max_seq_len=128, capture=False)
    assert graphs.batch_sizes == (1, 2, 4, 8) and pool.num_usable_pages == 23
    prompts = [_prompt(n, seed=60 + n) for n in (9, 23, 17, 30, 12)]
    pages = [pool.allocator.allocate(pool.pages_for(len(p) + 1)) for p in prompts]
    assert all(graphs.dummy_page not in pg for pg in pages)
    lens, _, _ = _prefill(model, pool, prompts, pages)
    decoder_caches = [c for layer in pool.caches[: config.num_hidden_layers] for c in layer.tensors()]
    before = [cache.clone() for cache in decoder_caches]  # (the MTP layer's cache is not run)
    load = _moe_load(model)

    _, logits = graphs.run(DecodeRows([p[-1] for p in prompts], lens, pages))
    assert logits.shape == (5, config.vocab_size)
    assert dict(graphs.steps) == {8: 1} and graphs.padding_rows == 3
    for i, p in enumerate(prompts):
        compare(hf_logits(tiny_ckpt.hf_model, p)[-1], logits[i])
    moe_layers = sum(isinstance(layer.mlp, MoE) for layer in model.model.layers)
    assert _moe_load(model) - load == 5 * config.num_experts_per_tok * moe_layers
    written = {pg[n // PAGE] * PAGE + n % PAGE for pg, n in zip(pages, lens, strict=True)}
    for old, new in zip(before, decoder_caches, strict=True):
        changed = (old != new).any(dim=-1).flatten().nonzero().flatten().tolist()
        assert set(changed) - written <= set(range(graphs.dummy_page * PAGE, (graphs.dummy_page + 1) * PAGE))
        assert written <= set(changed)

    # the next step of three sequences reads the latents the first one wrote
    extended = [[*p, int(logits[i].argmax())] for i, p in enumerate(prompts[:3])]
    _, logits = graphs.run(DecodeRows([p[-1] for p in extended], [len(p) - 1 for p in extended], pages[:3]))
    assert dict(graphs.steps) == {8: 1, 4: 1} and graphs.padding_rows == 4
    for i, p in enumerate(extended):
        compare(hf_logits(tiny_ckpt.hf_model, p)[-1], logits[i])


PROMPT_LENS = (5, 19, 11, 27, 8, 14, 22)
MAX_TOKENS = (12, 3, 9, 6, 12, 1, 8)  # sequences finish at different steps: the batch shrinks


def _generate(llm: LLM, max_tokens: tuple[int, ...] = MAX_TOKENS) -> list[list[int]]:
    prompts = [_prompt(n, seed=n) for n in PROMPT_LENS[: len(max_tokens)]]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.kv.num_available_pages() == llm.engine.kv.num_pages, "KV pages leaked"
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("checkpoint", ["tiny_ckpt", "tiny_ckpt_v32"])
def test_engine_decode_through_static_buffers_gives_eager_tokens(
    checkpoint: str, request: pytest.FixtureRequest
) -> None:
    tiny_ckpt: BuiltCheckpoint = request.getfixturevalue(checkpoint)
    eager = make_llm(tiny_ckpt)
    assert eager.engine.runner.decode_graphs is None  # CPU: no graphs unless asked for
    expected = _generate(eager)
    eager.engine.close()

    llm = make_llm(tiny_ckpt)
    graphs = llm.engine.runner.enable_decode_graphs(
        max_batch_size=8, max_seq_len=llm.engine.max_model_len, capture=False
    )
    got = _generate(llm)
    llm.engine.close()
    assert got == expected
    assert sum(graphs.steps.values()) >= 8 and len(graphs.steps) >= 3, graphs.steps  # several buckets
    assert graphs.padding_rows > 0


@pytest.mark.parametrize("width", [2, 3], ids=["one-draft", "two-drafts"])
@pytest.mark.parametrize("checkpoint", ["tiny_ckpt", "tiny_ckpt_v32"])
def test_draft_layer_through_static_buffers_equals_eager(
    checkpoint: str, width: int, request: pytest.FixtureRequest
) -> None:
    """After a verification of ``width`` tokens a sequence through the static buffers, the draft
    layer's callable (``width`` rows per sequence, those past the accepted drafts on the dummy page,
    the last valid row found by a device index, the cached length from a device buffer) gives the
    eager draft layer's hidden states at each sequence's last valid position, for drafts accepted
    and rejected, in a padded bucket; with two drafts, a chained draft through the chain callable
    gives the eager chained draft's normed states and logits."""
    from dsinfer.engine.draft_graph import DraftGraphs, DraftRows

    tiny_ckpt: BuiltCheckpoint = request.getfixturevalue(checkpoint)
    loaded = load_model(tiny_ckpt.path, select_ops("cpu"), dtype=torch.float32, num_mtp_layers=1)
    model, config = loaded.model, loaded.config
    pool = PagedKVPool.for_model(config, model.num_cache_layers, 24, torch.float32, "cpu", page_size=PAGE)
    graphs = CudaGraphRunner(
        model, pool, max_batch_size=4, max_seq_len=128, capture=False, tokens_per_seq=(1, width)
    )
    draft = DraftGraphs(graphs, capture=False, chained=width > 2)
    prompts = [_prompt(n, seed=80 + n) for n in (14, 31, 9)]
    pages = [pool.allocator.allocate(pool.pages_for(len(p) + 2 * width)) for p in prompts]
    lens, hidden, prefill = _prefill(model, pool, prompts, pages)
    # the MTP layer's cache over the prompts, as the eager proposer fills it at prefill
    model.forward_mtp(hidden, torch.tensor([t for p in prompts for t in p[1:]]), prefill, pool.caches)

    drafts = [[7, 8, 9][: width - 1], [300, 301, 302][: width - 1], [42, 43, 44][: width - 1]]
    verify = DecodeRows(
        [t for p, d in zip(prompts, drafts, strict=True) for t in (p[-1], *d)], lens, pages, q_len=width
    )
    verified, _ = graphs.run(verify)
    verified = verified.clone()
    valid = [width, 1, 2]  # every draft accepted; the first rejected; one accepted
    following = [[*d[: v - 1], 11 + i][:v] for i, (d, v) in enumerate(zip(drafts, valid, strict=True))]
    got = draft.run(
        DraftRows([t for f in following for t in f + [0] * (width - len(f))], lens, valid, pages, width)
    ).clone()

    rows = [r for i, v in enumerate(valid) for r in range(width * i, width * i + v)]
    want = model.forward_mtp(
        verified[rows],
        torch.tensor([t for f in following for t in f]),
        _eager_batch(pool, pages, lens, valid),
        pool.caches,
        last_only=True,
    )
    assert got.shape == want.shape == (3, config.hidden_size) and dict(draft.steps) == {4: 1}
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    if width > 2:  # a chained draft of the first and third sequences, after their last valid rows
        keep, tokens = [0, 2], [501, 502]
        normed = model.mtp_head(want)[0][keep]
        starts = [lens[i] + valid[i] for i in keep]
        chained = [t.clone() for t in draft.run_chain(tokens, starts, [pages[i] for i in keep], normed)]
        eager = _eager_batch(pool, [pages[i] for i in keep], starts, [1, 1])
        out = model.forward_mtp(normed, torch.tensor(tokens), eager, pool.caches, last_only=True)
        for a, b in zip(chained, model.mtp_head(out), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert dict(draft.chain_steps) == {2: 1}
    with pytest.raises(ValueError, match=f"no verification of 2 sequences of {width} tokens"):
        graphs.run(DecodeRows([1, 2], [3, 4], pages[:2]))
        draft.run(
            DraftRows([1] + [0] * (width - 1) + [2] + [0] * (width - 1), [3, 4], [1, 1], pages[:2], width)
        )


def _eager_batch(
    pool: PagedKVPool, pages: list[list[int]], starts: list[int], counts: list[int]
) -> ForwardBatch:
    """The eager batch of ``counts[i]`` new tokens from ``starts[i]`` per sequence."""
    return ForwardBatch(
        positions=torch.tensor([p + j for p, n in zip(starts, counts, strict=True) for j in range(n)]),
        slot_mapping=torch.tensor(
            [
                pg[p // PAGE] * PAGE + p % PAGE
                for pg, s, n in zip(pages, starts, counts, strict=True)
                for p in range(s, s + n)
            ]
        ),
        block_tables=pool.block_table(pages),
        q_lens=counts,
        kv_lens=[s + n for s, n in zip(starts, counts, strict=True)],
    )


def _generate_with_drafts(
    llm: LLM, every: bool = False, max_tokens: tuple[int, ...] = MAX_TOKENS
) -> tuple[list[list[int]], list[Any]]:
    """``_generate``, and the drafts the MTP layer proposed at each step (``every``: all of each
    sequence's, else the first or None)."""
    proposer = llm.engine.runner.mtp
    assert proposer is not None
    drafts: list[Any] = []
    propose = proposer.propose

    def recording(*args: Any) -> None:
        propose(*args)
        if every:
            drafts.append([list(result.next_drafts) for result in args[3]])
        else:
            drafts.append([result.next_drafts[0] if result.next_drafts else None for result in args[3]])

    proposer.propose = recording  # type: ignore[method-assign]
    return _generate(llm, max_tokens), drafts


@pytest.mark.parametrize("agreeing", [False, True], ids=["random", "agreeing"])
@pytest.mark.parametrize("checkpoint", ["tiny_ckpt", "tiny_ckpt_v32"])
def test_mtp_verification_through_static_buffers_gives_eager_tokens(
    checkpoint: str, agreeing: bool, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """With MTP every all-decode step verifies a draft per sequence: two tokens each, run through
    the static buffers' two-token buckets (causal over the last token and the draft), and the MTP
    draft layer after it through its own (two rows per sequence, a rejected draft's on the dummy
    page). The tokens equal the eager engine's with MTP and without it, and every step's drafts
    equal the eager draft layer's: on random weights (drafts mostly rejected) and on a checkpoint
    whose MTP layer agrees with the model (mostly accepted: both rows of a sequence valid)."""
    ckpt: BuiltCheckpoint = request.getfixturevalue(checkpoint)
    if agreeing:
        ckpt = BuiltCheckpoint(agreeing_mtp_checkpoint(ckpt, tmp_path / "agreeing"), ckpt.hf_model, {}, None)
    plain = make_llm(ckpt)
    expected = _generate(plain)
    plain.engine.close()
    eager = make_llm(ckpt, speculative_mtp=True)
    assert _generate_with_drafts(eager)[0] == expected
    eager_drafts = _generate_with_drafts(eager)[1]  # (a second round: the first one's prefix cache is warm)
    eager.engine.close()

    llm = make_llm(ckpt, speculative_mtp=True)
    graphs = llm.engine.runner.enable_decode_graphs(
        max_batch_size=8, max_seq_len=llm.engine.max_model_len, capture=False
    )
    assert graphs.tokens_per_seq == (1, 2)
    assert _generate(llm) == expected
    got, drafts = _generate_with_drafts(llm)
    stats = llm.engine.scheduler.stats
    llm.engine.close()
    assert got == expected and drafts == eager_drafts
    assert stats.acceptance_rate > 0.5 if agreeing else stats.drafts_proposed > 0, stats
    assert graphs.steps_by_q[2] >= 4 and len(graphs.steps) >= 2, (graphs.steps_by_q, graphs.steps)
    draft = llm.engine.runner.draft_graphs
    assert draft is not None and sum(draft.steps.values()) == graphs.steps_by_q[2]  # each one's draft layer


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_decode_replays_eager_tokens_on_gpu(tiny_ckpt: BuiltCheckpoint) -> None:
    """Captured decode steps give the eager tokens, and with MTP so do captured verifications, the
    draft layers after them and, with two drafts a step, the chained drafts."""
    eager = make_llm(tiny_ckpt, device="cuda", enforce_eager=True)
    assert eager.engine.runner.decode_graphs is None
    expected = _generate(eager)
    eager.engine.close()

    llm = make_llm(tiny_ckpt, device="cuda", max_num_seqs=8)
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None and graphs.capture and graphs.batch_sizes == (1, 2, 4, 8)
    assert graphs._rows_host.is_pinned() and graphs._tables_host.is_pinned()  # async H2D copies
    got = _generate(llm)
    assert got == expected
    assert sum(graphs.steps.values()) >= 8 and graphs.padding_rows > 0, graphs.steps
    # one replay against the same padded callable run eagerly, on the same sequences' pages
    runner = llm.engine.runner
    same = CudaGraphRunner(runner.model, runner.pool, max_batch_size=8, max_seq_len=512, capture=False)
    pages = runner.pool.allocator.allocate(3)
    rows = DecodeRows([5, 9, 300], [0, 40, 130], [pages[:1], pages[:1], pages])
    _, eager_logits = same.run(rows)
    eager_logits = eager_logits.clone()
    _, replayed = graphs.run(rows)
    compare(eager_logits, replayed)
    runner.pool.allocator.free(pages)
    llm.engine.close()

    mtp = make_llm(tiny_ckpt, device="cuda", max_num_seqs=8, speculative_mtp=True)
    graphs = mtp.engine.runner.decode_graphs
    assert graphs is not None and graphs.tokens_per_seq == (1, 2)
    assert _generate(mtp) == expected  # verification steps and draft layers replayed from graphs
    assert graphs.steps_by_q[2] >= 4, graphs.steps_by_q
    draft = mtp.engine.runner.draft_graphs
    assert draft is not None and draft.capture and sum(draft.steps.values()) == graphs.steps_by_q[2]
    mtp.engine.close()

    chained = make_llm(
        tiny_ckpt, device="cuda", max_num_seqs=8, speculative_mtp=True, speculative_num_steps=2
    )
    graphs = chained.engine.runner.decode_graphs
    assert graphs is not None and graphs.tokens_per_seq == (1, 3)
    assert _generate(chained) == expected  # chained drafts replayed from their own graphs
    draft = chained.engine.runner.draft_graphs
    assert draft is not None and draft.chained and sum(draft.chain_steps.values()) >= 4, draft.chain_steps
    chained.engine.close()

    by_batch = make_llm(
        tiny_ckpt, device="cuda", max_num_seqs=8, speculative_mtp=True, speculative_num_steps=2,
        speculative_steps_by_batch="4:1",
    )  # fmt: skip
    graphs = by_batch.engine.runner.decode_graphs
    assert graphs is not None and graphs.tokens_per_seq == (1, 2, 3)
    assert _generate(by_batch) == expected  # verifications of both widths replayed
    assert graphs.steps_by_q[2] >= 2, graphs.steps_by_q  # four on CPU through the same callables
    by_batch.engine.close()


def test_chained_drafts_through_the_static_buffers_give_eager_tokens(
    tiny_ckpt: BuiltCheckpoint, tmp_path: Path
) -> None:
    """Three drafts a step with the static buffers on: verifications of four tokens a sequence
    replay, then the draft layer over their valid rows and each chained draft through the chain
    callable; steps whose sequences verify fewer drafts (a lone request whose max_tokens leaves
    room for one draft after its prompt) run eagerly. The tokens are plain decoding's, and every
    step's drafts are the eager MTP engine's."""
    ckpt = BuiltCheckpoint(
        agreeing_mtp_checkpoint(tiny_ckpt, tmp_path / "agreeing"), tiny_ckpt.hf_model, {}, None
    )
    short = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    LONG = (40, 33, 36, 29)

    def generate(llm: LLM) -> tuple[list[list[int]], list[list[list[int]]]]:
        lone = llm.generate([_prompt(9, seed=9)], short, use_tqdm=False)[0].outputs[0].token_ids
        tokens, drafts = _generate_with_drafts(llm, every=True, max_tokens=LONG)
        return [*tokens, lone], drafts

    plain = make_llm(ckpt)
    expected = [
        *_generate(plain, LONG),
        plain.generate([_prompt(9, seed=9)], short, use_tqdm=False)[0].outputs[0].token_ids,
    ]
    plain.engine.close()
    eager = make_llm(ckpt, speculative_mtp=True, speculative_num_steps=3)
    want, eager_drafts = generate(eager)
    eager.engine.close()
    assert want == expected
    llm = make_llm(ckpt, speculative_mtp=True, speculative_num_steps=3)
    graphs = llm.engine.runner.enable_decode_graphs(
        max_batch_size=8, max_seq_len=llm.engine.max_model_len, capture=False
    )
    assert graphs.tokens_per_seq == (1, 4)
    got, drafts = generate(llm)
    stats = llm.engine.scheduler.stats
    draft = llm.engine.runner.draft_graphs
    llm.engine.close()
    assert got == expected and drafts == eager_drafts
    assert stats.drafts_proposed > stats.draft_verifications, stats  # steps with several drafts
    assert graphs.steps_by_q[4] >= 4, graphs.steps_by_q
    assert draft is not None and sum(draft.steps.values()) == graphs.steps_by_q[4]
    assert sum(draft.chain_steps.values()) >= 2 * graphs.steps_by_q[4], draft.chain_steps


def test_fewer_drafts_at_larger_batches_through_the_static_buffers(
    tiny_ckpt: BuiltCheckpoint, tmp_path: Path
) -> None:
    """``speculative_steps_by_batch``: one draft a step while three or more sequences run, three
    below. The graphs hold verifications of both widths (2 and 4 tokens a sequence) and the draft
    layer after each; the short requests finish first and the long one goes on alone, so both
    replay, with plain decoding's tokens and the eager engine's drafts at every step."""
    ckpt = BuiltCheckpoint(
        agreeing_mtp_checkpoint(tiny_ckpt, tmp_path / "agreeing"), tiny_ckpt.hf_model, {}, None
    )
    LONG = (60, 12, 10, 8)  # three finish early, the last one runs alone
    plain = make_llm(ckpt)
    expected = _generate(plain, LONG)
    plain.engine.close()
    schedule = {"speculative_mtp": True, "speculative_num_steps": 3, "speculative_steps_by_batch": "3:1"}
    eager = make_llm(ckpt, **schedule)
    want, eager_drafts = _generate_with_drafts(eager, every=True, max_tokens=LONG)
    eager.engine.close()
    assert want == expected
    llm = make_llm(ckpt, **schedule)
    graphs = llm.engine.runner.enable_decode_graphs(
        max_batch_size=8, max_seq_len=llm.engine.max_model_len, capture=False
    )
    assert graphs.tokens_per_seq == (1, 2, 4)
    got, drafts = _generate_with_drafts(llm, every=True, max_tokens=LONG)
    draft = llm.engine.runner.draft_graphs
    llm.engine.close()
    assert got == expected and drafts == eager_drafts
    assert graphs.steps_by_q[2] >= 2 and graphs.steps_by_q[4] >= 8, graphs.steps_by_q
    assert draft is not None and sum(draft.steps.values()) == graphs.steps_by_q[2] + graphs.steps_by_q[4]
