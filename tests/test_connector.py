"""The KV connector's rules on their own (no engine, no transfer, no process): the decode side's
deadline renewed by the prefill side's progress, given up after silence, its pages held until
fenced; the gateway's pairing; the control plane's codec; the timeout's floor. The whole handoff
with real engines and transfers is tests/test_pd_workers.py."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import pytest

from dsinfer.base import protocol
from dsinfer.base.protocol import Abort, GenerateRequest, Register, TokenDelta
from dsinfer.base.sampling_params import SamplingParams
from dsinfer.connector import pairing
from dsinfer.connector.decode import DecodeConnector
from dsinfer.connector.messages import (
    PROGRESS_INTERVAL,
    DecodeAdmit,
    KVDestination,
    PrefillDone,
    TransferAborted,
    TransferProgress,
    decode,
)
from dsinfer.engine.step import KVReservation
from dsinfer.workers.args import PoolArgs

TIMEOUT, QUARANTINE = 10.0, 60.0


@dataclass
class _Request:
    request_id: str


@dataclass
class _Remote:
    """The engine's ``remote`` as the decode side drives it: 4 pages per request."""

    free: list[int] = field(default_factory=lambda: list(range(100)))
    held: dict[str, list[int]] = field(default_factory=dict)

    def new(self, request_id: str, prompt: list[int], params: SamplingParams, *args: object) -> _Request:
        return _Request(request_id)

    def reserve(self, request: _Request) -> KVReservation | None:
        if len(self.free) < 4:
            return None
        pages, self.free = self.free[:4], self.free[4:]
        self.held[request.request_id] = pages
        return KVReservation(0, pages)

    def cancel(self, request: _Request) -> list[int]:
        return self.held.pop(request.request_id)


@dataclass
class _Pages:
    released: list[int] = field(default_factory=list)
    handoff_layer: int | None = None  # a V3 pool: pages only

    def release(self, pages: list[int]) -> None:
        self.released += pages


@dataclass
class _Engine:
    remote: _Remote = field(default_factory=_Remote)
    kv_pages: _Pages = field(default_factory=_Pages)


@dataclass
class _Outbox:
    gateway: list[msgspec.Struct] = field(default_factory=list)
    peers: list[tuple[str, msgspec.Struct]] = field(default_factory=list)

    def send_gateway(self, message: msgspec.Struct) -> None:
        self.gateway.append(message)

    def send_peer(self, inbox: str, message: msgspec.Struct) -> None:
        self.peers.append((inbox, message))


def _connector() -> tuple[DecodeConnector, _Engine, _Outbox, list[tuple[str, str]]]:
    engine, outbox, failed = _Engine(), _Outbox(), []

    def fail(request_id: str, error: str, retryable: bool = False) -> None:
        assert retryable, "a transfer's failure is retried elsewhere, not the request's end"
        failed.append((request_id, error))

    connector = DecodeConnector(
        engine,  # type: ignore[arg-type]
        outbox,
        "decode/0/0",
        fail,
        inbox="inbox://decode",
        transfer_timeout=TIMEOUT,
        quarantine=QUARANTINE,
    )
    return connector, engine, outbox, failed


def _admit(rid: str) -> DecodeAdmit:
    return DecodeAdmit(
        request_id=rid,
        prompt_token_ids=[1, 2, 3],
        params=SamplingParams(seed=1),
        prefill_worker="prefill/0/0",
        prefill_inbox="inbox://prefill",
    )


def test_progress_keeps_a_queued_transfer_alive_and_silence_ends_it() -> None:
    connector, engine, outbox, failed = _connector()
    connector.admit(_admit("a"), now=0.0)
    connector.admit(_admit("b"), now=0.0)
    assert [type(m) for m in outbox.gateway] == [KVDestination, KVDestination]
    for t in range(1, 26):  # 50 s at the prefill rank: "a" reported every 2 s, "b" never
        now = t * PROGRESS_INTERVAL
        connector.progress(TransferProgress(request_ids=["a"]), now)
        connector.tick(now)
    assert [rid for rid, _ in failed] == ["b"] and "no sign of the KV transfer" in failed[0][1]
    assert ("inbox://prefill", Abort(request_id="b", fence_to="inbox://decode")) in outbox.peers
    assert engine.kv_pages.released == []  # "b"'s pages wait for its fence
    connector.fenced("b")  # TransferAborted from the prefill rank
    assert len(engine.kv_pages.released) == 4 and connector.num_waiting() == 1


def test_pages_of_a_given_up_transfer_return_at_the_fence_or_after_quarantine() -> None:
    connector, engine, _, failed = _connector()
    for rid in ("x", "y", "z"):
        connector.admit(_admit(rid), now=0.0)
    assert connector.abort("x", now=1.0) and connector.abort("y", now=1.0)
    assert connector.done(PrefillDone(request_id="x", first_token=5)) is None  # a late done: the fence
    assert len(engine.kv_pages.released) == 4
    connector.peer_down("prefill/0/0")  # fences "y" (quarantined) and fails "z" (reserved)
    assert len(engine.kv_pages.released) == 12 and [rid for rid, _ in failed] == ["z"]
    assert not connector.busy()


def test_quarantine_expires() -> None:
    connector, engine, _, _ = _connector()
    connector.admit(_admit("q"), now=0.0)
    connector.abort("q", now=0.0)
    connector.tick(QUARANTINE - 1)
    assert engine.kv_pages.released == []
    connector.tick(QUARANTINE)
    assert len(engine.kv_pages.released) == 4


def test_admission_waits_for_pages() -> None:
    connector, engine, outbox, _ = _connector()
    engine.remote.free = list(range(6))  # room for one request
    connector.admit(_admit("first"), now=0.0)
    connector.admit(_admit("second"), now=0.0)
    assert [m.request_id for m in outbox.gateway] == ["first"] and connector.num_waiting() == 2
    connector.abort("first", now=0.0)
    connector.fenced("first")
    engine.remote.free += engine.kv_pages.released
    connector.tick(1.0)
    assert [m.request_id for m in outbox.gateway] == ["first", "second"]


def test_pairing() -> None:
    prefill = Register(worker="prefill/0/0", role="prefill", pool=0, incarnation="i", inbox="inbox://p",
                       kv_pages_total=8, page_size=64, max_model_len=512, model="m")  # fmt: skip
    decode_rank = Register(worker="decode/0/0", role="decode", pool=0, incarnation="j", inbox="inbox://d",
                           transfer_agent="agent", transfer_metadata=b"meta", kv_pages_total=8,
                           page_size=64, max_model_len=512, model="m")  # fmt: skip
    request = GenerateRequest(
        request_id="r/0", prompt_token_ids=[1, 2], params=SamplingParams(seed=3), choice=1
    )
    admit = pairing.decode_admit(request, prefill)
    assert (admit.prefill_worker, admit.prefill_inbox, admit.choice) == ("prefill/0/0", "inbox://p", 1)
    dest = KVDestination(request_id="r/0", worker="decode/0/0", num_cached_tokens=0, pages=[3, 4])
    sent = pairing.prefill_request(admit, dest, decode_rank)
    assert sent is not None and sent.destination == dest and sent.decode_agent == "agent"
    assert sent.decode_inbox == "inbox://d" and sent.decode_transfer_metadata == b"meta"
    stray = KVDestination(request_id="r/0", worker="decode/1/0", num_cached_tokens=0, pages=[3, 4])
    assert pairing.prefill_request(admit, stray, decode_rank) is None


def test_the_control_codec_knows_both_families() -> None:
    for message in (
        TransferProgress(request_ids=["a", "b"]),
        TransferAborted(request_id="a"),
        TokenDelta(request_id="a", token_ids=[1]),
        _admit("a"),
    ):
        assert decode(protocol.encode(message)) == message
    with pytest.raises(msgspec.ValidationError):  # the core codec alone does not know the connector's
        protocol.decode(protocol.encode(TransferAborted(request_id="a")))


def test_a_timeout_below_three_progress_reports_is_refused() -> None:
    with pytest.raises(ValueError, match="kv_transfer_timeout must be at least 6 s"):
        PoolArgs(role="decode", gateway_addr="127.0.0.1:1", kv_transfer_timeout=2.0)
    assert PoolArgs(role="decode", gateway_addr="127.0.0.1:1").kv_transfer_timeout == 30.0
