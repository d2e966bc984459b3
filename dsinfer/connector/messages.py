"""The PD handoff's messages, and the control plane's codec, which knows them and the core ones.

Who sends what (docs/serving.md has the whole flow):

- gateway -> decode rank: DecodeAdmit (reserve pages for the prompt); PeerDown when a prefill rank
  died (the fence of every transfer from it).
- decode rank -> gateway: KVDestination (where the prefill rank writes).
- gateway -> prefill rank: PrefillRequest (compute the prompt, write its KV there).
- prefill rank -> decode rank (PUSH -> the decode rank's inbox): TransferProgress for the requests
  it holds, every ``PROGRESS_INTERVAL`` s (queued or computing, so the decode rank's deadline
  measures silence, not the prefill queue); PrefillDone after its last KV write completed;
  TransferAborted once no write of an aborted transfer can still land.
- decode rank -> prefill rank (PUSH -> the prefill rank's inbox): the core Abort of a transfer the
  decode side gave up on, with ``fence_to`` set.
"""

from __future__ import annotations

from typing import Any

import msgspec

from dsinfer.base.protocol import CORE_MESSAGES, Codec, ControlMessage, Message, WorkerRequest

__all__ = [
    "CONTROL",
    "PD_MESSAGES",
    "PROGRESS_INTERVAL",
    "AnyMessage",
    "DecodeAdmit",
    "KVDestination",
    "PeerDown",
    "PrefillDone",
    "PrefillRequest",
    "TransferAborted",
    "TransferProgress",
    "decode",
]

PROGRESS_INTERVAL = 2.0  # seconds between a prefill rank's TransferProgress to one decode rank


class DecodeAdmit(WorkerRequest, kw_only=True):
    """Reserve pages for the prompt, answer with KVDestination, then wait for PrefillDone."""

    prefill_worker: str
    prefill_inbox: str


class KVDestination(ControlMessage, kw_only=True):
    """Decode's answer to DecodeAdmit: where the prefill rank writes the prompt's KV.

    The decode rank already holds the first ``num_cached_tokens`` prompt tokens (its prefix
    cache; a multiple of the page size); ``pages`` are its pages for the prompt's remaining
    pages in order, pre-allocated and reserved for this request until the transfer ends."""

    request_id: str
    worker: str
    num_cached_tokens: int
    pages: list[int]
    handoff_slot: int | None = None  # DeepSeek-V4: where the resume point at the last whole page goes


class PrefillRequest(WorkerRequest, kw_only=True):
    """Compute the prompt, write its KV into ``destination`` layer by layer, then PrefillDone."""

    destination: KVDestination
    decode_inbox: str
    decode_agent: str
    decode_transfer_metadata: bytes


class PeerDown(ControlMessage, kw_only=True):
    """Gateway -> decode ranks: prefill rank ``worker`` is dead (its launcher saw the process
    exit, PoolDown or RankDown), so none of its KV writes can land any more: the fence of every
    transfer from it, as TransferAborted is for one (sent before the rank can register again)."""

    worker: str


class PrefillDone(ControlMessage, kw_only=True):
    """Every KV write of the request has completed; decode may start from ``first_token``."""

    request_id: str
    first_token: int
    first_logprobs: dict[int, float] | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefill rank served from its own cache
    mtp_draft: int | None = None  # the MTP layer's proposal after first_token
    computed_tokens: int | None = None  # V4: tokens whose KV (and resume point) arrived; None: all
    bytes_written: int = 0
    bytes_by_group: dict[str, int] = msgspec.field(default_factory=dict)  # bytes_written by cache group
    first_write_at: float = 0.0  # time.time() when the first KV write started
    forward_done_at: float = 0.0  # time.time() when the forward that sampled first_token ended


class TransferAborted(ControlMessage, kw_only=True):
    """Fence: no write of this request's transfer can land any more."""

    request_id: str


class TransferProgress(ControlMessage, kw_only=True):
    """Prefill rank -> decode rank: these transfers are alive here (queued behind other prompts,
    computing, or writing); each restarts the decode rank's deadline for its pages."""

    request_ids: list[str]


PD_MESSAGES: tuple[type[ControlMessage], ...] = (
    DecodeAdmit,
    KVDestination,
    PrefillRequest,
    PeerDown,
    PrefillDone,
    TransferAborted,
    TransferProgress,
)
AnyMessage = (
    Message
    | DecodeAdmit
    | KVDestination
    | PrefillRequest
    | PeerDown
    | PrefillDone
    | TransferAborted
    | TransferProgress
)
CONTROL = Codec(CORE_MESSAGES + PD_MESSAGES)


def decode(frame: bytes) -> Any:
    """Any control message (``AnyMessage``) from one frame; raises on an unknown tag or a frame
    over the size limit."""
    return CONTROL.decode(frame)
