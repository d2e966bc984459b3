"""The prefill and decode roles in one process, wired by a harness that plays the gateway:
real engines, real NIXL transfers between their KV pools, the real protocol messages (each one
encoded and decoded as on the wire).

Checks: PD tokens equal the offline engine's (greedy, seeded, n > 1 split into choices, stop
strings, logprobs); bytes sent = pages x layers x page bytes; the first layer's write starts
before the prefill forward ends; a decode prefix hit sends fewer pages; an abort mid-transfer
and a transfer that never completes both free every page on both sides.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
import torch

from dsinfer import LLM, SamplingParams
from dsinfer.base.protocol import Abort, TokenDelta, encode
from dsinfer.cache.v4_pool import V4StatePool
from dsinfer.connector.messages import DecodeAdmit, KVDestination, PrefillDone, PrefillRequest, decode
from dsinfer.engine.args import EngineArgs
from dsinfer.engine.engine import LLMEngine
from dsinfer.transfer.base import TransferBackend, TransferError
from dsinfer.transfer.factory import make_transfer_backend
from dsinfer.workers.decode import DecodeWorker
from dsinfer.workers.prefill import PrefillWorker
from dsinfer.workers.role import load_report
from harness.checkpoints import BuiltCheckpoint
from harness.v4_checkpoints import build_v4, greedy_reference

pytestmark = pytest.mark.system

PREFILL_INBOX, DECODE_INBOX = "inbox://prefill", "inbox://decode"
ENGINE = {"dtype": "float32", "kv_cache_memory": "8MiB", "max_num_batched_tokens": 40}


class Harness:
    """Gateway and wire for one prefill and one decode role."""

    def __init__(self, engines: list[LLMEngine], backends: list[TransferBackend]) -> None:
        self.engines, self.backends = engines, backends
        self.prefill = PrefillWorker(
            engines[0], self, "prefill/0/0", "p0", backends[0], quarantine=30.0, progress_interval=0.05
        )
        self.decode = DecodeWorker(
            engines[1], self, "decode/0/0", "d0", inbox=DECODE_INBOX, transfer_timeout=30.0, quarantine=30.0
        )
        self.inboxes = {PREFILL_INBOX: self.prefill, DECODE_INBOX: self.decode}
        self.to_gateway: list[object] = []
        self.wire: list[tuple[str, bytes]] = []
        self.admits: dict[str, DecodeAdmit] = {}
        self.done_messages: list[PrefillDone] = []
        self.held: set[str] = set()  # destinations not forwarded (a prefill that never comes)
        self.prefill_paused = False  # the prefill rank busy with other prompts: it ticks, never steps
        self.tick_seconds: float | None = None  # set: the roles' clock advances this much per cycle

    def now(self) -> float:
        """The time the roles see: real, or a clock that advances ``tick_seconds`` per cycle (so a
        test of deadlines does not depend on how long a forward takes on a loaded machine)."""
        return time.monotonic() if self.tick_seconds is None else self._virtual

    def use_virtual_clock(self, tick_seconds: float | None) -> None:
        self.tick_seconds, self._virtual = tick_seconds, time.monotonic()

    # Outbox of both roles
    def send_gateway(self, message: msgspec.Struct) -> None:
        self.to_gateway.append(decode(encode(message)))

    def send_peer(self, inbox: str, message: msgspec.Struct) -> None:
        self.wire.append((inbox, encode(message)))

    def admit(
        self,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        choice: int = 0,
        output: list[int] | None = None,
    ) -> None:
        msg = DecodeAdmit(
            request_id=rid,
            prompt_token_ids=prompt,
            params=dataclasses.replace(params, n=1, seed=params.seed if params.seed is not None else 1234),
            choice=choice,
            output_token_ids=output or [],
            prefill_worker="prefill/0/0",
            prefill_inbox=PREFILL_INBOX,
        )
        self.admits[rid] = msg
        self.decode.handle(msg, self.now())

    def abort(self, rid: str) -> None:
        for role in (self.prefill, self.decode):
            role.handle(Abort(request_id=rid), self.now())

    def cycle(self) -> list[TokenDelta]:
        if self.tick_seconds is not None:
            self._virtual += self.tick_seconds
        now = self.now()
        deltas = []
        for message in self.to_gateway:
            if isinstance(message, KVDestination):
                if message.request_id not in self.held:
                    self._prefill(message)
            elif isinstance(message, TokenDelta):
                deltas.append(message)
        self.to_gateway = []
        for backend in self.backends:
            backend.progress()
        for role in (self.prefill, self.decode):
            role.tick(now)
            if role is self.prefill and self.prefill_paused:
                continue
            if role.has_work():  # each role a pool of one rank: its own votes are the agreement
                plan = role.engine.plan_step()
                role.step(plan, role.engine.agree(plan.votes))
        wire, self.wire = self.wire, []
        for inbox, frame in wire:
            message = decode(frame)
            if isinstance(message, PrefillDone):
                self.done_messages.append(message)
            self.inboxes[inbox].handle(message, self.now())
        return deltas

    def _prefill(self, dest: KVDestination) -> None:
        admit = self.admits[dest.request_id]
        self.prefill.handle(
            PrefillRequest(
                request_id=admit.request_id,
                prompt_token_ids=admit.prompt_token_ids,
                params=admit.params,
                choice=admit.choice,
                output_token_ids=admit.output_token_ids,
                destination=dest,
                decode_inbox=DECODE_INBOX,
                decode_agent=self.backends[1].agent_name,
                decode_transfer_metadata=self.backends[1].metadata(),
            ),
            self.now(),
        )

    def run(self, rids: list[str], timeout: float = 60.0) -> dict[str, list[TokenDelta]]:
        deltas: dict[str, list[TokenDelta]] = defaultdict(list)
        open_ = set(rids)
        deadline = time.monotonic() + timeout
        while open_:
            assert time.monotonic() < deadline, f"requests {sorted(open_)} did not finish"
            for delta in self.cycle():
                deltas[delta.request_id].append(delta)
                if delta.finish_reason or delta.error:
                    open_.discard(delta.request_id)
        return deltas

    def settle(self, timeout: float = 10.0) -> None:
        """Run until neither role holds anything (transfers, quarantine)."""
        deadline = time.monotonic() + timeout
        while self.prefill.busy() or self.decode.busy():
            assert time.monotonic() < deadline, "roles did not settle"
            self.cycle()

    def all_pages_free(self) -> bool:
        return all(e.kv.num_available_pages() == e.kv.num_pages for e in self.engines)


@contextlib.contextmanager
def make_harness(ckpt: BuiltCheckpoint, backend: str = "nixl", **engine: object) -> Iterator[Harness]:
    """Two engines on ``ckpt`` (prefill, decode) with their pools registered on ``backend``."""
    backends = [make_transfer_backend(backend, f"test-{backend}-{r}-{time.time_ns()}") for r in ("p", "d")]
    engines = [LLMEngine(EngineArgs(model=str(ckpt.path), **{**ENGINE, **engine})) for _ in range(2)]
    try:
        for e, b in zip(engines, backends, strict=True):
            b.register_pool(e.kv.pool.layer_tensors())
        yield Harness(engines, backends)
    finally:
        for e, b in zip(engines, backends, strict=True):
            b.close()
            e.close()


@pytest.fixture(scope="module")
def harness(tiny_ckpt: BuiltCheckpoint) -> Iterator[Harness]:
    with make_harness(tiny_ckpt) as h:
        yield h


@pytest.fixture(scope="module")
def offline(tiny_ckpt: BuiltCheckpoint) -> LLM:
    return LLM(str(tiny_ckpt.path), **ENGINE)


def _tokens(deltas: list[TokenDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def _prompts() -> list[list[int]]:
    return [list(range(5, 5 + n)) for n in (3, 64, 100, 150)]


def test_pd_tokens_equal_offline(harness: Harness, offline: LLM) -> None:
    cases = [
        SamplingParams(temperature=0, max_tokens=12, logprobs=2),
        SamplingParams(temperature=0.9, top_k=40, seed=7, max_tokens=10, n=2),
    ]
    for params in cases:
        prompts = _prompts()
        expected = offline.generate(prompts, params, use_tqdm=False)
        rids = []
        for p, prompt in enumerate(prompts):
            for choice in range(params.n):
                rid = f"{id(params)}-{p}/{choice}"
                harness.admit(rid, prompt, params, choice)
                rids.append(rid)
        deltas = harness.run(rids)
        for p, out in enumerate(expected):
            for choice, completion in enumerate(out.outputs):
                got = deltas[f"{id(params)}-{p}/{choice}"]
                assert _tokens(got) == completion.token_ids, (p, choice)
                assert got[-1].finish_reason == completion.finish_reason
                if params.logprobs is not None:
                    got_lp = [lp for d in got for lp in d.logprobs or []]
                    assert [set(d) for d in got_lp] == [set(d) for d in completion.logprobs]
    harness.settle()
    assert harness.all_pages_free()


def test_pd_stop_string_and_first_token_finish(harness: Harness, offline: LLM) -> None:
    prompt = list(range(40, 90))
    probe = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    stop = probe.outputs[0].text[3:6]
    for params in (
        SamplingParams(temperature=0, max_tokens=8, stop=[stop]),
        SamplingParams(temperature=0, max_tokens=1),
    ):
        expected = offline.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        rid = f"stop-{params.max_tokens}"
        harness.admit(rid, prompt, params)
        got = harness.run([rid])[rid]
        assert _tokens(got) == expected.token_ids
        assert got[-1].finish_reason == expected.finish_reason
    harness.settle()
    assert harness.all_pages_free()


def test_transfer_bytes_and_layer_overlap(harness: Harness) -> None:
    harness.done_messages.clear()
    prompt = list(range(7, 7 + 150))  # 3 pages, written over 4 chunks of 40 tokens
    harness.admit("bytes", prompt, SamplingParams(temperature=0, max_tokens=2))
    harness.run(["bytes"])
    done = harness.done_messages[-1]
    pool = harness.engines[0].kv.pool
    page_bytes = pool.spec.page_bytes
    assert done.bytes_written == 3 * pool.num_layers * page_bytes
    assert 0 < done.first_write_at < done.forward_done_at
    harness.settle()
    assert harness.all_pages_free()


def test_decode_prefix_hit_sends_fewer_pages(harness: Harness) -> None:
    shared = list(range(200, 200 + 128))
    harness.admit("first", [*shared, 1, 2, 3], SamplingParams(temperature=0, max_tokens=2))
    harness.run(["first"])
    harness.done_messages.clear()
    harness.admit("second", [*shared, 4, 5, 6], SamplingParams(temperature=0, max_tokens=2))
    harness.run(["second"])
    pool = harness.engines[0].kv.pool
    page_bytes = pool.spec.page_bytes
    assert harness.done_messages[-1].bytes_written == 1 * pool.num_layers * page_bytes  # only the 3rd page
    harness.settle()
    assert harness.all_pages_free()


def test_abort_mid_transfer_frees_both_sides(harness: Harness) -> None:
    prompt = list(range(300, 300 + 150))
    harness.admit("gone", prompt, SamplingParams(temperature=0, max_tokens=50))
    for _ in range(3):  # destination forwarded, some chunks prefilled and written
        harness.cycle()
    harness.abort("gone")
    harness.settle()
    assert harness.all_pages_free()


def test_abort_before_the_prefill_rank_got_it_fences_at_once(harness: Harness) -> None:
    """A client gone between the decode rank's reservation and the PrefillRequest: the prefill
    rank answers the decode rank's abort with the fence at once (the pages do not wait out the
    30 s quarantine), and refuses the request if it still comes (no write into freed pages)."""
    harness.held.add("early")
    harness.admit("early", list(range(20, 90)), SamplingParams(temperature=0, max_tokens=4))
    dest = None
    while dest is None:
        pending = [m for m in harness.to_gateway if isinstance(m, KVDestination)]
        dest = pending[0] if pending else None
        harness.cycle()
    harness.abort("early")
    harness.settle(timeout=5.0)
    assert harness.all_pages_free()
    harness._prefill(dest)  # the gateway's PrefillRequest, overtaken by the abort
    refused = [d for d in harness.cycle() if d.request_id == "early"]
    assert refused and refused[-1].error is not None and "aborted before" in refused[-1].error
    assert not harness.prefill.busy() and not harness.engines[0].has_request("early")
    assert harness.all_pages_free()


def test_transfer_that_never_completes_times_out(harness: Harness) -> None:
    connector = harness.decode.connector
    connector.transfer_timeout, connector.quarantine = 0.2, 0.3
    try:
        harness.held.add("lost")
        harness.admit("lost", list(range(10, 80)), SamplingParams(temperature=0, max_tokens=4))
        got = harness.run(["lost"], timeout=10)["lost"]
        assert got[-1].error is not None and "no sign of the KV transfer" in got[-1].error
        harness.settle()
        assert harness.all_pages_free()
    finally:
        connector.transfer_timeout, connector.quarantine = 30.0, 30.0


def test_a_transfer_queued_at_the_prefill_rank_outlives_the_timeout(harness: Harness, offline: LLM) -> None:
    """The decode rank's deadline measures the prefill rank's silence, not its queue: a prompt
    that waits at the prefill rank 10x longer than --kv-transfer-timeout completes with the
    offline engine's tokens while the prefill rank reports progress, and times out without it.
    The roles' clock advances 0.05 s per cycle, so forwards' real durations do not matter."""
    connector, prefill = harness.decode.connector, harness.prefill.connector
    params = SamplingParams(temperature=0, max_tokens=5)
    prompt = list(range(30, 100))
    expected = offline.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    connector.transfer_timeout = 0.5
    harness.use_virtual_clock(0.05)
    try:
        for name, interval in (("queued", 0.2), ("silent", float("inf"))):
            prefill.progress_interval = interval
            harness.prefill_paused = True
            harness.admit(name, prompt, params)
            got: list[TokenDelta] = []
            for _ in range(100):  # 5 s of the roles' clock
                got += [d for d in harness.cycle() if d.request_id == name]
            harness.prefill_paused = False
            if not any(d.error or d.finish_reason for d in got):
                got += harness.run([name], timeout=60)[name]
            if name == "queued":
                assert got[-1].error is None and _tokens(got) == expected
            else:
                assert got[-1].error is not None and "no sign of the KV transfer" in got[-1].error
            harness.settle()
            assert harness.all_pages_free()
    finally:
        connector.transfer_timeout, prefill.progress_interval, harness.prefill_paused = 30.0, 0.05, False
        harness.use_virtual_clock(None)


def _greedy_equals_offline(h: Harness, offline: LLM, tag: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=10)
    prompts = _prompts()
    expected = offline.generate(prompts, params, use_tqdm=False)
    for p, prompt in enumerate(prompts):
        h.admit(f"{tag}-{p}", prompt, params)
    deltas = h.run([f"{tag}-{p}" for p in range(len(prompts))])
    for p, out in enumerate(expected):
        assert _tokens(deltas[f"{tag}-{p}"]) == out.outputs[0].token_ids, p
    h.settle()
    assert h.all_pages_free()


def test_pd_with_mtp_sends_the_mtp_layer_and_keeps_tokens(tiny_ckpt: BuiltCheckpoint, offline: LLM) -> None:
    """Both sides speculate with the MTP layer: its KV rides with the decoder layers' (the pool
    has one more layer) and the draft proposed on the prefill side reaches the decode side."""
    with make_harness(tiny_ckpt, speculative_mtp=True) as mtp:
        _greedy_equals_offline(mtp, offline, "mtp")
        pool = mtp.engines[0].kv.pool
        assert pool.num_layers == mtp.engines[0].config.num_hidden_layers + 1
        page_bytes = pool.spec.page_bytes
        assert mtp.done_messages[-1].mtp_draft is not None
        pages = sum(-(-len(prompt) // pool.page_size) for prompt in _prompts())
        assert sum(d.bytes_written for d in mtp.done_messages) == pages * pool.num_layers * page_bytes
        # the decode side's drafts reach /metrics through its load report
        reports = [load_report("w", "i", engine.load()) for engine in mtp.engines]
        assert sum(r.mtp_drafts_proposed for r in reports) > 0
        assert all(0 <= r.mtp_drafts_accepted <= r.mtp_drafts_proposed for r in reports)
        # and /metrics turns them into the acceptance rate and the tokens a verification yields
        from prometheus_client import CollectorRegistry, generate_latest

        from dsinfer.gateway.backend import BackendMetrics, WorkerStatus
        from dsinfer.gateway.metrics import BackendCollector
        from harness.metrics import metric_value

        decode = max(reports, key=lambda r: r.mtp_drafts_proposed)
        registry = CollectorRegistry()
        registry.register(
            BackendCollector(lambda: BackendMetrics(0, 0, [WorkerStatus("d/0/0", "decode", True, decode)]))
        )
        text = generate_latest(registry).decode()
        rate = decode.mtp_drafts_accepted / decode.mtp_drafts_proposed
        labels = {"worker": "d/0/0", "role": "decode"}
        assert metric_value(text, "dsinfer_spec_decode_acceptance_rate", **labels) == pytest.approx(rate)
        assert metric_value(text, "dsinfer_spec_decode_mean_accepted_length", **labels) == pytest.approx(
            1 + rate
        )


def test_pd_with_chained_mtp_drafts_keeps_tokens(tiny_ckpt: BuiltCheckpoint, offline: LLM) -> None:
    """Three drafts a step: the prefill side hands on the first, the decode side verifies it and
    then chains three a step; tokens as offline, every page freed."""
    with make_harness(tiny_ckpt, speculative_mtp=True, speculative_num_steps=3) as mtp:
        _greedy_equals_offline(mtp, offline, "chained")
        decode = max((engine.scheduler.stats for engine in mtp.engines), key=lambda s: s.drafts_proposed)
        assert decode.drafts_proposed > decode.draft_verifications > 0, decode


def test_pd_over_mooncake(tiny_ckpt: BuiltCheckpoint, offline: LLM) -> None:
    """The same hand-over through the other backend (skipped where Mooncake is not installed)."""
    try:
        make_transfer_backend("mooncake", f"test-probe-{time.time_ns()}").close()
    except TransferError as e:
        pytest.skip(f"Mooncake Transfer Engine is not usable here: {e}")
    with make_harness(tiny_ckpt, "mooncake") as mc:
        _greedy_equals_offline(mc, offline, "mc")


def test_pd_v32_sends_latent_and_indexer_pages(tiny_ckpt_v32: BuiltCheckpoint) -> None:
    """V3.2 over PD: each page carries every layer's latent and indexer keys. The byte counter is
    pages x layers x (latent + indexer bytes per token) x page size, with the sizes read from the
    config (not from the pool), and the decode side's tokens are the offline engine's."""
    config = tiny_ckpt_v32.config
    latent = (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 4  # float32
    indexer = config["index_head_dim"] * 4
    prompts = [list(range(9, 9 + n)) for n in (20, 150)]
    params = SamplingParams(temperature=0, max_tokens=6)
    offline = LLM(str(tiny_ckpt_v32.path), **ENGINE)
    expected = [o.outputs[0].token_ids for o in offline.generate(prompts, params, use_tqdm=False)]
    offline.engine.close()
    with make_harness(tiny_ckpt_v32) as h:
        for i, prompt in enumerate(prompts):
            h.done_messages.clear()
            h.admit(f"v32-{i}", prompt, params)
            got = h.run([f"v32-{i}"])[f"v32-{i}"]
            assert _tokens(got) == expected[i]
            pages = -(-len(prompt) // 64)
            layers = config["num_hidden_layers"]
            assert h.done_messages[-1].bytes_written == pages * layers * (latent + indexer) * 64
        h.settle()
        assert h.all_pages_free()


def test_pd_v4_sends_whole_pages_and_the_resume_point(tmp_path: Path) -> None:
    """DeepSeek-V4 over PD: the prefill rank writes a prompt's whole pages (each compressing
    layer's entries and indexer keys) and, in a handoff slot, the resume point at the last of
    them; the decode rank computes the rest of the prompt itself. PrefillDone says how far the KV
    goes (0 for a prompt shorter than a page), the bytes are those pages and one slot, and the
    tokens are transformers'. After aborts at any point, every page and slot is free on both
    sides."""
    model = build_v4("flash_like", tmp_path, with_tokenizer=True)
    lengths, params = (100, 256, 600), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[2 + (1000 * i + t) % 4000 for t in range(n)] for i, n in enumerate(lengths)]
    with make_harness(SimpleNamespace(path=tmp_path), max_num_seqs=8) as h:  # type: ignore[arg-type]
        pools = [e.kv.pool for e in h.engines]
        assert all(isinstance(p, V4StatePool) for p in pools)
        page_bytes = V4StatePool.page_bytes_for(pools[0].caches.config, torch.float32)
        for i, prompt in enumerate(prompts):
            h.done_messages.clear()
            h.admit(f"v4-{i}", prompt, params)
            got = h.run([f"v4-{i}"])[f"v4-{i}"]
            assert _tokens(got) == greedy_reference(model, prompt, 6)
            whole = len(prompt) // 256
            done = h.done_messages[-1]
            assert done.computed_tokens == whole * 256
            slot = pools[0].handoff.slot_bytes if whole else 0  # type: ignore[union-attr]
            assert done.bytes_written == whole * page_bytes + slot
        for cycles in (3, 16, 18):  # aborted while prefilling, around its last chunk, after it
            h.admit(f"gone-{cycles}", [3 + t % 3000 for t in range(600)], params)
            for _ in range(cycles):
                h.cycle()
            h.abort(f"gone-{cycles}")
        h.settle()
        assert h.all_pages_free()
        assert all(p.handoff.num_free == 8 for p in pools)  # type: ignore[union-attr]
