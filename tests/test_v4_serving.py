"""DeepSeek-V4 through the engine and the servers, against transformers' DeepseekV4ForCausalLM.

Tiny V4 checkpoints (harness/v4_checkpoints.py: every layer type, hash layers, mHC, a window of 8
or 12 raw tokens, compression at 4 and 16 or 8, top-3 or top-5 indexer picks) carry the built-in
tiny tokenizer. Greedy tokens must equal transformers' for prompts of 8 to 1,000 tokens batched
together in chunks that end mid-window and mid-compression-block; through preemption (the
sequence computed again from nothing); through ``dsinfer generate`` and ``dsinfer serve``
(colocated); through a choice migrated after its rank is killed. Each sequence's hybrid cache is gone once it finishes or is aborted. MTP is
tests/test_v4_mtp.py's; EPLB, elastic EP and pools over several nodes are
tests/test_v4_eplb.py's, tests/test_v4_elastic.py's and tests/test_serve_multinode.py's.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from dsinfer.base.config import ConfigError
from dsinfer.base.model_config import model_config_from_dict
from dsinfer.base.sampling_params import SamplingParams
from dsinfer.base.tokenizer import Tokenizer
from dsinfer.base.v4_config import V4Config
from dsinfer.cache.v4_pool import V4StatePool
from dsinfer.engine.llm import LLM
from harness.metrics import healthy, metric_value, parse_metrics
from harness.server import run_dsinfer, serve, wait_until
from harness.streams import join_streams, mixed_specs, offline_tokens, start_streams, wait_streaming
from harness.v4_checkpoints import CONFIGS, TOKENIZER_VOCAB, build_v4, greedy_reference

pytest.importorskip("transformers")

LENGTHS = (8, 37, 130, 400, 1000)
OUTPUT = 10
IDS = {"return_tokens_as_token_ids": True}
GREEDY = SamplingParams(temperature=0, max_tokens=OUTPUT, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def v4(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    directory = tmp_path_factory.mktemp(f"v4_served_{request.param}")
    return directory, build_v4(request.param, directory, with_tokenizer=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(2, TOKENIZER_VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def expected(v4: tuple[Path, Any]) -> list[list[int]]:
    return [greedy_reference(v4[1], prompt, OUTPUT) for prompt in _prompts()]


def _tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]


def _assert_nothing_held(llm: LLM) -> None:
    kv = llm.engine.kv
    assert len(kv.pool.caches) == 0, "a sequence's V4 cache outlived it"
    assert kv.num_available_pages() == kv.num_pages


def test_offline_engine_equals_transformers_in_chunks(
    v4: tuple[Path, Any], expected: list[list[int]]
) -> None:
    """Five prompts at once, prefill chunks of at most 96 tokens shared between them."""
    llm = LLM(str(v4[0]), dtype="float32", max_num_batched_tokens=96, max_num_seqs=5)
    assert _tokens(llm, _prompts()) == expected
    _assert_nothing_held(llm)


def test_preempted_sequences_are_computed_again(v4: tuple[Path, Any], expected: list[list[int]]) -> None:
    """Eight pages for five sequences of up to five pages each: the scheduler preempts, and a
    preempted sequence's cache starts again from nothing."""
    config, dtype = V4Config.model_validate_json((v4[0] / "config.json").read_text()), torch.float32
    memory = V4StatePool.reserve_bytes_for(config, dtype, 5) + 8 * V4StatePool.page_bytes_for(config, dtype)
    small = LLM(
        str(v4[0]), dtype="float32", max_num_batched_tokens=256, max_num_seqs=5, kv_cache_memory=memory
    )
    assert small.engine.kv.num_pages == 8
    assert _tokens(small, _prompts()) == expected
    assert small.engine.scheduler.stats.preemptions > 0
    _assert_nothing_held(small)


def test_prefix_cache_hits_resume_at_a_page_boundary(v4: tuple[Path, Any]) -> None:
    """A prompt sharing 600 tokens with a finished one hits its first two pages (512 tokens) and
    resumes there: the window's rows and CSA's overlap rows at the boundary come from the resume
    point kept for that page, the compressed entries from the shared pages; the 200 tokens after
    the hit end mid-block (200 is no multiple of 16). A conversation's next turn (the first
    prompt, its answer, more) hits up to the last full page the answer completed while decoding. Tokens equal transformers'
    on the whole prompts, and equal the same engine's without the prefix cache."""
    llm = LLM(str(v4[0]), dtype="float32", max_num_batched_tokens=96)
    first = _prompts()[4][:760]  # its answer crosses the third page's end while decoding
    answer = _tokens(llm, [first])[0]
    assert answer == greedy_reference(v4[1], first, OUTPUT)
    g = torch.Generator().manual_seed(9)
    branch = first[:600] + torch.randint(2, TOKENIZER_VOCAB, (200,), generator=g).tolist()
    turn = first + answer + torch.randint(2, TOKENIZER_VOCAB, (90,), generator=g).tolist()
    before = llm.engine.kv.stats.memory_hit_tokens
    assert _tokens(llm, [branch]) == [greedy_reference(v4[1], branch, OUTPUT)]
    assert llm.engine.kv.stats.memory_hit_tokens - before == 512
    before = llm.engine.kv.stats.memory_hit_tokens
    assert _tokens(llm, [turn]) == [greedy_reference(v4[1], turn, OUTPUT)]
    assert llm.engine.kv.stats.memory_hit_tokens - before == 768  # 769 computed tokens: 3 full pages
    cold = LLM(str(v4[0]), dtype="float32", max_num_batched_tokens=96, enable_prefix_caching=False)
    assert _tokens(cold, [branch, turn]) == _tokens(llm, [branch, turn])
    _assert_nothing_held(cold)
    assert len(llm.engine.kv.pool.caches) == 0


def test_host_tier_gives_back_evicted_pages_with_their_resume_points(v4: tuple[Path, Any]) -> None:
    """Four pages for prompts of three: the second prompt evicts the first's tail page into the
    host tier (its record carries the page's resume point); the first prompt again hits a page in
    the pool and one in the tier, resumes at 512 and answers as transformers does."""
    config, dtype = V4Config.model_validate_json((v4[0] / "config.json").read_text()), torch.float32
    memory = V4StatePool.reserve_bytes_for(config, dtype, 2) + 4 * V4StatePool.page_bytes_for(config, dtype)
    llm = LLM(str(v4[0]), dtype="float32", max_num_seqs=2, kv_cache_memory=memory, kv_host_cache_size="16MiB")
    g = torch.Generator().manual_seed(13)
    first, second = (torch.randint(2, TOKENIZER_VOCAB, (600,), generator=g).tolist() for _ in range(2))
    want = greedy_reference(v4[1], first, OUTPUT)
    assert _tokens(llm, [first]) == [want]
    _tokens(llm, [second])
    assert llm.engine.kv.stats.host_pages_written == 1
    assert _tokens(llm, [first]) == [want]
    stats = llm.engine.kv.stats
    assert (stats.memory_hit_tokens, stats.host_hit_tokens) == (256, 256)


def test_abort_frees_the_sequence_cache(v4: tuple[Path, Any]) -> None:
    llm = LLM(str(v4[0]), dtype="float32", max_num_batched_tokens=64)
    engine = llm.engine
    engine.add_request("r", _prompts()[3], SamplingParams(temperature=0, max_tokens=50))
    for _ in range(8):
        engine.step()
    assert len(engine.kv.pool.caches) == 1
    held = engine.kv.pool.caches.nbytes()
    assert held["window"] > 0 and held["compressed"] > 0
    engine.abort_request("r")
    assert not engine.has_unfinished_requests()
    _assert_nothing_held(llm)


@pytest.mark.system
def test_generate_command_equals_transformers(v4: tuple[Path, Any]) -> None:
    text = "The window slides while the compressor keeps every fourth token"
    ids = Tokenizer.from_dir(v4[0]).encode(text)
    done = run_dsinfer(
        "generate",
        "--model",
        str(v4[0]),
        "--dtype",
        "float32",
        "--prompt",
        text,
        "--max-tokens",
        "6",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["token_ids"] == greedy_reference(v4[1], ids, 6)


@pytest.mark.system
@pytest.mark.parametrize("mode", ["pd", "colocated", "ep"])
def test_serve_equals_transformers(
    v4: tuple[Path, Any], expected: list[list[int]], mode: str, tmp_path: Path
) -> None:
    """`dsinfer serve` on a V4 checkpoint, PD (the prompt's whole pages and the resume point at
    the last of them written over NIXL, the rest computed on the decode rank), colocated, or a
    colocated expert-parallel pool of 2 ranks, answers what transformers does, streamed or not,
    for prompts shorter than a page and of several pages."""
    prompts = _prompts()
    flags = {"pd": [], "colocated": ["--colocated"], "ep": ["--colocated", "--decode-pool-size", "2"]}[mode]
    with serve(["--model", str(v4[0]), "--dtype", "float32", *flags], tmp_path) as server:
        client = server.openai_client()
        for prompt, want in zip(prompts, expected, strict=True):
            whole = client.completions.create(
                model=v4[0].name, prompt=prompt, max_tokens=OUTPUT, temperature=0, logprobs=0, extra_body=IDS
            )
            tokens = [int(t.removeprefix("token_id:")) for t in whole.choices[0].logprobs.tokens]
            assert tokens == want
        streamed = client.completions.create(
            model=v4[0].name, prompt=prompts[2], max_tokens=OUTPUT, temperature=0, stream=True
        )
        text = "".join(chunk.choices[0].text for chunk in streamed if chunk.choices)
        assert text == whole_text(client, v4[0].name, prompts[2])
        if mode == "pd":  # the prompts of more than a page: their whole pages and a resume point each
            want = _transfer_bytes_by_group(v4[0], prompts)
            for worker in ("prefill/0/0", "decode/0/0"):  # written, and received

                def got(worker: str = worker) -> dict[str, float]:
                    text = server.metrics()
                    name = "dsinfer_kv_transfer_group_bytes_total"
                    return {g: metric_value(text, name, worker=worker, group=g) for g in want}

                wait_until(lambda got=got: got() == want, f"transfer bytes by group {want}", 10)


def _transfer_bytes_by_group(directory: Path, prompts: list[list[int]]) -> dict[str, float]:
    """What the cache spec says a PD transfer of ``prompts`` writes, per group: each prompt's whole
    pages of every paged group, and the resume point at the last of them (a handoff slot)."""
    config = V4Config.model_validate_json((directory / "config.json").read_text())
    spec = V4StatePool.spec_for(config, torch.float32)
    whole = sum(len(p) // spec.page_tokens for p in prompts)
    want = {g.name: float(whole * spec.page_bytes(g)) for g in spec.groups if g.name != "window"}
    points = sum(1 for p in prompts if len(p) >= spec.page_tokens)
    want["resume_point"] = float(points * V4StatePool.handoff_slot_bytes_for(config, torch.float32))
    return want


@pytest.mark.system
@pytest.mark.parametrize("mode", ["colocated", "pd"])
def test_choice_migrated_after_a_rank_is_killed_keeps_every_token(
    v4: tuple[Path, Any], mode: str, tmp_path: Path
) -> None:
    """Two colocated pools, or PD with two decode pools; one (decode) rank killed with kill -9
    while 6 streams run (half greedy, half seeded at temperature 0.8): each dead rank's choice goes
    on on the other pool from the tokens it had delivered, computing its V4 cache again (PD: a
    prefill rank hands it over again), and ends with the undisturbed run's tokens."""
    specs = mixed_specs(6, "Migrate a V4 stream", 60)
    expected = offline_tokens(LLM(str(v4[0]), dtype="float32", max_num_batched_tokens=64), specs)
    args = [
        "--model",
        str(v4[0]),
        "--dtype",
        "float32",
        "--max-num-batched-tokens",
        "64",
        "--decode-pools",
        "2",
        *(["--colocated"] if mode == "colocated" else []),
    ]
    role, pools = ("colocated", 2) if mode == "colocated" else ("decode", 3)
    with serve(args, tmp_path) as server:  # ready with one pool: wait for all, or the kill fails the start
        wait_until(lambda: len(healthy(parse_metrics(server.metrics()))) == pools, "every pool up", 120)
        victims = server.rank_pids(role, pool=0)
        assert len(victims) == 1
        streams = start_streams(server.openai_client(), specs)
        wait_streaming(streams, timeout=120, context=lambda: server.log()[-3000:])
        os.kill(victims[0], signal.SIGKILL)
        join_streams(streams, timeout=120)
        assert [s.result for s in streams] == [("ok", "length")] * len(specs), [s.result for s in streams]
        assert [s.tokens for s in streams] == expected
        migrated = metric_value(
            server.metrics(), "dsinfer_choice_migrations_total", cause="rank_died", streaming="true"
        )
        assert migrated >= 1


def whole_text(client: Any, model: str, prompt: list[int]) -> str:
    done = client.completions.create(model=model, prompt=prompt, max_tokens=OUTPUT, temperature=0)
    return done.choices[0].text


def test_disk_tier_serves_a_hit_after_a_restart(v4: tuple[Path, Any], tmp_path: Path) -> None:
    """A page's record holds its compressed groups and its resume point: an engine started
    afterwards on the same directory, its memory empty, hits 512 tokens from disk and answers as
    transformers does; a damaged file is rejected, never served."""
    directory = str(tmp_path / "kv")
    first = _prompts()[4][:700]
    writer = LLM(str(v4[0]), dtype="float32", max_num_batched_tokens=96, kv_disk_cache_dir=directory)
    _tokens(writer, [first])
    writer.engine.kv.flush()
    assert writer.engine.kv.stats.disk_pages_written == 2
    # a page's record: every paged group's page as the spec sizes it, and a resume point
    config, pool = writer.engine.config, writer.engine.kv.pool
    spec = V4StatePool.spec_for(config, torch.float32)
    groups = sum(spec.page_bytes(g) for g in spec.groups if g.name != "window")
    assert pool.page_record_bytes == groups + V4StatePool.handoff_slot_bytes_for(config, torch.float32)
    reader = LLM(str(v4[0]), dtype="float32", max_num_batched_tokens=96, kv_disk_cache_dir=directory)
    g = torch.Generator().manual_seed(5)
    branch = first[:600] + torch.randint(2, TOKENIZER_VOCAB, (150,), generator=g).tolist()
    assert _tokens(reader, [branch]) == [greedy_reference(v4[1], branch, OUTPUT)]
    stats = reader.engine.kv.stats
    assert (stats.disk_hit_tokens, stats.memory_hit_tokens, stats.disk_files_rejected) == (512, 0, 0)
    files = list((tmp_path / "kv").glob("[0-9a-f]*"))
    for path in files:
        path.write_bytes(path.read_bytes()[:-7] + b"damaged")
    third = LLM(str(v4[0]), dtype="float32", max_num_batched_tokens=96, kv_disk_cache_dir=directory)
    assert _tokens(third, [branch]) == [greedy_reference(v4[1], branch, OUTPUT)]
    # both pages were asked for ahead of the step, each file checked and rejected
    stats = third.engine.kv.stats
    assert (stats.disk_hit_tokens, stats.disk_files_rejected) == (0, len(files)) and len(files) == 2


def test_invalid_v4_config_is_named_in_one_line() -> None:
    with pytest.raises(ConfigError) as info:
        model_config_from_dict({"model_type": "deepseek_v4", "hidden_size": 64}, "ckpt/config.json")
    message = str(info.value)
    assert message.startswith("ckpt/config.json: DeepSeek-V4 config: ") and "vocab_size" in message
    assert "\n" not in message


@pytest.mark.system
def test_dry_run_plans_the_released_flash_on_a_gpu() -> None:
    """The preset's plan: each cache group, one request's cache next to V3's, the experts kept
    MXFP4 on a GPU, a one-line refusal where the weights cannot fit one GPU, and a plan that fits
    two ranks of an expert-parallel pool."""
    done = run_dsinfer("serve", "--model", "deepseek-v4-flash", "--dry-run", "--device", "cuda", timeout=120)
    assert done.returncode == 0, done.stderr
    plan = done.stdout
    for line in (
        "window      43 layers x 512 values per token, the last 127 tokens: 5.3 MiB per sequence",
        "c4          21 layers x 512 values per 4 tokens: 5,376 B per token",
        "c4_indexer  21 layers x 128 values per 4 tokens: 1,344 B per token",
        "c128        20 layers x 512 values per 128 tokens: 160 B per token",
        "one request at 1,048,576 tokens: 6.7 GiB (6,891 B per token); deepseek-v3: 68.6 GiB (70,272 B per token)",
    ):
        assert line in plan, plan
    gpu = ["--role", "colocated", "--gateway-addr", "127.0.0.1:1", "--gpu-memory", "141GB"]
    refused = run_dsinfer(
        "serve", "--model", "deepseek-v4-flash", "--dry-run", "--device", "cuda", *gpu, timeout=120
    )
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode != 0 and len(lines) == 1, refused.stderr
    assert "DeepSeek-V4 on a rank of a pool of 1 needs 144.9 GiB of weights" in lines[0]
    assert "routed experts 137.1 GiB (MXFP4, kept packed)" in plan
    fits = run_dsinfer(
        "serve",
        "--model",
        "deepseek-v4-flash",
        "--dry-run",
        "--device",
        "cuda",
        *gpu,
        "--pool-size",
        "2",
        timeout=120,
    )
    assert fits.returncode == 0, fits.stderr
    assert "(MXFP4, kept packed; 128 of 256 slots per rank)" in fits.stdout and "fits" in fits.stdout


@pytest.mark.system
def test_dry_run_pages_are_the_engine_pages(v4: tuple[Path, Any]) -> None:
    done = run_dsinfer(
        "serve", "--model", str(v4[0]), "--dry-run", "--dtype", "float32", "--kv-cache-memory", "16MiB"
    )
    assert done.returncode == 0, done.stderr
    llm = LLM(str(v4[0]), dtype="float32", kv_cache_memory="16MiB")
    assert f" + {llm.engine.kv.num_pages} pages of " in done.stdout, done.stdout


@pytest.mark.system
@pytest.mark.parametrize(("redundant", "overlap"), [(0, False), (2, False), (0, True)])
def test_expert_parallel_pool_equals_transformers(
    v4: tuple[Path, Any], tmp_path: Path, redundant: int, overlap: bool
) -> None:
    """A 2-rank expert-parallel pool (gloo all-to-all; each rank attends its own prompts and holds
    its expert slots, a hash layer routing by the token ids where the tokens are), with redundant
    experts, and with two micro-batches per step (prefill and decode schedules, an idle rank's
    and a one-sequence rank's empty micro-batch joining the exchanges): greedy tokens equal
    transformers'; the ranks together hold every expert, each only its slots."""
    from tests.test_ep import run_pool

    prompts = _prompts()[:4]
    if overlap:  # prompts that end together: each rank decodes two sequences after them
        prompts = [p[:40] for p in _prompts()[2:]] * 2
    extra = {"enable_overlap": True, "overlap_min_tokens": 1} if overlap else {}
    results = run_pool(
        v4[0], 2, tmp_path, prompts, max_tokens=OUTPUT, num_redundant_experts=redundant, **extra
    )
    if overlap:
        steps = [r["two_micro_batch_steps"] for r in results]
        assert all(s["prefill"] > 0 and s["decode"] > 0 for s in steps), steps
    tokens = {rid: t for r in results for rid, t in r["tokens"].items()}
    assert tokens == {f"p{i}": greedy_reference(v4[1], p, OUTPUT) for i, p in enumerate(prompts)}
    experts = v4[1].config.n_routed_experts
    for layer in range(v4[1].config.num_hidden_layers):
        held = [r["v4_local_experts"][layer] for r in results]
        assert all(len(slots) == (experts + redundant) // 2 for slots in held)
        assert set().union(*map(set, held)) == set(range(experts))
    assert all(r["free_pages_ok"] for r in results)


def test_a_handed_over_resume_point_outlives_the_prefix_cache_lru(v4: tuple[Path, Any]) -> None:
    """A point a prefill rank handed over stays until its sequence resumes there, however many
    points the prefix cache takes in meanwhile; then it is the prefix cache's like any other."""
    from dsinfer.model.v4_paged import SequenceStates, resume_shapes

    config = V4Config.model_validate(json.loads((v4[0] / "config.json").read_text()))
    states = SequenceStates(config, 8, 256, torch.float32, torch.device("cpu"), max_resume_points=1)
    handed = states.boundary_from(256, resume_shapes(config, torch.float32))
    states.hand_over(2, handed)
    for page in (4, 5, 6):  # the LRU of one point turns over three times
        states.install(page, states.boundary_from(256, resume_shapes(config, torch.float32)))
    assert states.resumable(2)
    state = states.for_step("joined", 256, [2, 3])
    assert state.length == 256 and states.resume_point(2) is handed
    states.forget([2])
    assert not states.resumable(2)
