"""Control-plane messages between the gateway, the workers and the pool launchers: the core ones.

The PD handoff's messages (DecodeAdmit, KVDestination, PrefillRequest, PrefillDone,
TransferAborted, TransferProgress, PeerDown) belong to the KV connector
(dsinfer/connector/messages.py), which also holds the codec that decodes every control message.

Every message is a tagged msgspec Struct sent as one ZMQ frame of msgpack. Tensors never ride
the control plane: KV moves through the transfer library (dsinfer.transfer), activations through
the EP communicator. ``encode`` refuses a message over ``MAX_MESSAGE_BYTES`` and ``decode``
refuses a frame over it, so a bug cannot push a tensor's worth of bytes through ZMQ.

Who sends what (docs/serving.md has the whole flow):

- worker rank -> gateway (DEALER -> ROUTER at --gateway-addr): Register once per incarnation,
  then LoadReport every ``HEARTBEAT_INTERVAL`` s (it is also the heartbeat), KVDestination,
  TokenDeltas (the iteration's TokenDelta of every request, one message per step); Deregister
  when it stops after draining.
- launcher -> gateway: PoolDown when a rank of its pool died and the pool restarts whole;
  RankDown when one rank of a pool of several died and the survivors serve on (elastic EP).

Each sender connects with its own ZMQ identity: a rank's worker name, ``heartbeat_identity`` for
its heartbeat thread, ``launcher_identity`` for a pool launcher. The gateway accepts a message
only from the identity it speaks for (dsinfer/gateway/authorize.py), and only from peers that
passed the CURVE handshake with the cluster's keys (dsinfer/base/control_auth.py).
- gateway -> worker rank: GenerateRequest (colocated role), Abort; the connector's DecodeAdmit,
  PrefillRequest and PeerDown.
- between PD ranks: the connector's messages (dsinfer/connector/messages.py).

Request ids: the gateway splits a request with ``n`` choices per prompt into one worker request
per choice, each with ``params.n == 1``, ``params.seed`` set (one seed shared by the choices of a
prompt) and the choice's index among the prompt's ``n`` in ``choice`` (the sampler's key); the
id is ``dsinfer.base.request_id.format_request_id`` of (request, choice, attempt). The
counter-based sampler keyed by (seed, choice, position, draw) makes every choice identical to the
offline engine's, wherever its tokens are sampled. Workers are sent no stop strings: the gateway
owns them (docs/architecture.md).
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from dsinfer.base.sampling_params import SamplingParams

MAX_MESSAGE_BYTES = 16 * 2**20
HEARTBEAT_INTERVAL = 0.5  # seconds between LoadReports of one rank
HEARTBEAT_TIMEOUT = 5.0  # a rank silent this long is dead to the gateway
REGISTER_EVERY = 5.0  # seconds between a rank's Registers; also at once on each handshake with a gateway
EXPERT_LOAD_INTERVAL = 5.0  # seconds between LoadReports that carry the expert load

ROLES = ("prefill", "decode", "colocated")


class MessageTooLargeError(ValueError):
    pass


class ControlMessage(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    """Base of every control-plane message (the connector's too): tagged by its class name."""


# worker -> gateway -----------------------------------------------------------------------------
class Register(ControlMessage, kw_only=True):
    """A rank is up and serving. ``incarnation`` is new each time its pool (re)starts."""

    worker: str  # "<role>/<pool>/<rank>", e.g. "decode/1/0"
    role: str
    pool: int
    incarnation: str
    inbox: str  # tcp://host:port of this rank's PULL socket for peer messages
    transfer_agent: str = ""  # this rank's transfer-library agent name ("" for colocated)
    transfer_metadata: bytes = b""  # what a peer needs to write into this rank's KV pool
    kv_pages_total: int
    page_size: int  # tokens per KV page (the gateway's page hashes are taken per page)
    max_model_len: int  # prompt + generated tokens a request may have on this rank
    model: str  # the served model's identity (config hash); the gateway refuses a rank whose
    # model, page_size or max_model_len differ from the ranks already registered
    rejoined: bool = False  # a restarted rank that joined its running pool again (elastic EP)


class LoadReport(ControlMessage, kw_only=True):
    """Heartbeat plus the numbers the balancers and /metrics need. Counters are since start."""

    worker: str
    incarnation: str
    num_running: int = 0
    num_waiting: int = 0  # queued, including decode requests waiting for their KV
    kv_pages_used: int = 0
    kv_pages_total: int = 0
    pending_prefill_tokens: int = 0  # prompt tokens admitted or queued but not yet computed
    pending_attention_load: int = 0  # sum over queued prefills of new tokens x total context
    prompt_tokens: int = 0
    memory_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    host_hit_tokens: int = 0
    # per KV tier below the pool ("host", "disk"): counters by name (dsinfer.cache.cache_stats)
    kv_tiers: dict[str, dict[str, float]] = {}
    kv_disk_tier_id: str = ""  # the disk tier's directory id: ranks reporting one id share it
    mtp_drafts_proposed: int = 0  # MTP draft tokens verified since start
    mtp_drafts_accepted: int = 0  # of which the target model agreed with
    mtp_verifications: int = 0  # sequence-steps that verified drafts since start
    eplb_swaps: int = 0  # expert placements swapped in by online rebalancing
    transfer_bytes: int = 0  # KV bytes written (prefill) or received (decode)
    transfer_bytes_by_group: dict[str, int] = {}  # the same by cache group
    transfer_seconds: float = 0.0  # summed wall time from first write to completion
    transfers: int = 0
    # per request stage (dsinfer/base/stages.py): counts per bucket of STAGE_BUCKETS, seconds summed
    stage_counts: dict[str, list[int]] = {}
    stage_seconds: dict[str, float] = {}
    step_counts: list[int] = []  # the rank's forward steps: counts per bucket of STAGE_BUCKETS
    step_seconds: float = 0.0
    draining: bool = False
    # tokens this rank routed to each logical expert since start, per MoE layer id; sent every
    # EXPERT_LOAD_INTERVAL s (not with every heartbeat): the input of the expert load balancer
    expert_load: dict[int, list[int]] | None = None


class TokenDelta(ControlMessage, kw_only=True):
    """New tokens of one worker request; the last one has ``finish_reason`` or ``error``."""

    request_id: str
    token_ids: list[int] = []
    logprobs: list[dict[int, float]] | None = None  # one dict per token when asked
    prompt_logprobs: list[dict[int, float] | None] | None = None  # with the first delta
    num_prompt_tokens: int = 0  # with the first delta
    num_cached_tokens: int = 0  # prompt tokens served from a prefix cache (first delta)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    error: str | None = None  # the request failed; a one-line reason
    retryable: bool = False  # with error: refused before any work (e.g. draining); send it elsewhere


class TokenDeltas(ControlMessage, kw_only=True):
    """Every TokenDelta a rank produced in one iteration of its loop, in order: one message per
    rank per step instead of one per request per token."""

    deltas: list[TokenDelta]


class Heartbeat(ControlMessage, kw_only=True):
    """Sent by a rank's own thread, so a long step (or a slow machine) never looks like death."""

    worker: str
    incarnation: str


class Deregister(ControlMessage, kw_only=True):
    """A rank stops after draining: out of rotation at once, nothing of it is in flight."""

    worker: str
    incarnation: str


class PoolDown(ControlMessage, kw_only=True):
    role: str
    pool: int
    incarnation: str
    reason: str


class RankDown(ControlMessage, kw_only=True):
    """One rank of a pool of several died and the survivors serve on (elastic EP): that rank's
    incarnation leaves rotation, its choices move to other ranks; its launcher restarts it and
    it rejoins the pool (a new Register with ``rejoined``)."""

    worker: str
    incarnation: str
    reason: str


# gateway -> worker -----------------------------------------------------------------------------
class WorkerRequest(ControlMessage, kw_only=True):
    """Fields every request to a worker has: ``params.n == 1``, ``params.seed`` set, no stop strings."""

    request_id: str  # dsinfer.base.request_id.format_request_id
    prompt_token_ids: list[int]
    params: SamplingParams
    choice: int = 0  # index among the prompt's n choices: the sampler's key
    # a continuation (a choice migrated from a dead rank, as its next attempt): the tokens it
    # already delivered, prefilled after the prompt and counted as output (sampler position,
    # penalties, max_tokens), so the tokens that follow are the undisturbed choice's
    output_token_ids: list[int] = []
    traceparent: str = ""  # W3C: the gateway's span this work belongs to ("" = not traced)
    # the gateway had more requests in hand when it sent this one (others being tokenized, or
    # further choices of the same request): an idle rank gathers them before its first step
    more_coming: bool = False


class GenerateRequest(WorkerRequest, kw_only=True):
    """Colocated role: prefill and decode on the same rank."""


class Abort(ControlMessage, kw_only=True):
    """Drop the request. ``fence_to``: set by a PD decode rank that gave up a reserved transfer
    (to its own inbox): the prefill rank answers the connector's TransferAborted there once no
    write of the request can land (dsinfer/connector/prefill.py)."""

    request_id: str
    fence_to: str = ""


CORE_MESSAGES: tuple[type[ControlMessage], ...] = (
    Register,
    LoadReport,
    TokenDelta,
    TokenDeltas,
    PoolDown,
    RankDown,
    Heartbeat,
    Deregister,
    GenerateRequest,
    Abort,
)
Message = (
    Register
    | LoadReport
    | TokenDelta
    | TokenDeltas
    | PoolDown
    | RankDown
    | Heartbeat
    | Deregister
    | GenerateRequest
    | Abort
)

_encoder = msgspec.msgpack.Encoder()


class Codec:
    """Decodes the control messages of ``types`` (each tagged by its class name); frames over
    ``MAX_MESSAGE_BYTES`` are refused. The control plane's codec, which also knows the KV
    connector's messages, is ``dsinfer.connector.messages.CONTROL``."""

    def __init__(self, types: tuple[type[ControlMessage], ...]) -> None:
        self.types = types
        self._decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(Union[types])  # noqa: UP007

    def decode(self, frame: bytes) -> Any:
        if len(frame) > MAX_MESSAGE_BYTES:
            raise MessageTooLargeError(f"control frame of {len(frame)} bytes exceeds {MAX_MESSAGE_BYTES}")
        return self._decoder.decode(frame)


CORE = Codec(CORE_MESSAGES)


def encode(message: ControlMessage) -> bytes:
    data = _encoder.encode(message)
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageTooLargeError(
            f"{type(message).__name__} is {len(data)} bytes; the control plane carries at most "
            f"{MAX_MESSAGE_BYTES} (tensors go through the transfer library)"
        )
    return data


def decode(frame: bytes) -> Message:
    """A core message (what a launcher or a colocated rank sends; ``CORE``)."""
    return CORE.decode(frame)


def worker_name(role: str, pool: int, rank: int) -> str:
    return f"{role}/{pool}/{rank}"


def heartbeat_identity(worker: str) -> str:
    """The ZMQ identity of a rank's heartbeat socket (its main socket's is the worker name)."""
    return f"{worker}/heartbeat"


def launcher_identity(role: str, pool: int, node_rank: int) -> str:
    """The ZMQ identity of the launcher of one node of a pool."""
    return f"{role}/{pool}/launcher/{node_rank}"


def launcher_of(identity: str) -> tuple[str, int] | None:
    """(role, pool) of a ``launcher_identity``, else None."""
    parts = identity.split("/")
    if len(parts) != 4 or parts[2] != "launcher" or parts[0] not in ROLES:
        return None
    if not (parts[1].isdigit() and parts[3].isdigit()):
        return None
    return parts[0], int(parts[1])
