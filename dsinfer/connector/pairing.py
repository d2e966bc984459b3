"""The gateway's side of the handoff: a choice goes to a decode rank as DecodeAdmit naming its
prefill rank; the decode rank's KVDestination becomes the prefill rank's PrefillRequest, with the
decode rank's inbox and transfer agent. A dead prefill rank is announced to every decode rank
(PeerDown): the fence of every transfer from it."""

from __future__ import annotations

from typing import Any

import msgspec

from dsinfer.base.protocol import Register, WorkerRequest
from dsinfer.connector.messages import DecodeAdmit, KVDestination, PeerDown, PrefillRequest


def decode_admit(request: WorkerRequest, prefill: Register) -> DecodeAdmit:
    """``request`` (its fields) as the decode rank's admission, paired with ``prefill``."""
    return DecodeAdmit(**_request_fields(request), prefill_worker=prefill.worker, prefill_inbox=prefill.inbox)


def prefill_request(admit: DecodeAdmit, dest: KVDestination, decode: Register) -> PrefillRequest | None:
    """The prefill rank's request for ``dest``, or None when ``dest`` is not from the decode rank
    the choice was admitted to (a late answer of an earlier attempt)."""
    if dest.request_id != admit.request_id or dest.worker != decode.worker:
        return None
    return PrefillRequest(
        **_request_fields(admit),
        destination=dest,
        decode_inbox=decode.inbox,
        decode_agent=decode.transfer_agent,
        decode_transfer_metadata=decode.transfer_metadata,
    )


def _request_fields(request: WorkerRequest) -> dict[str, Any]:
    """``request``'s values of the fields every WorkerRequest has: what the handoff passes on."""
    return {field.name: getattr(request, field.name) for field in msgspec.structs.fields(WorkerRequest)}


def peer_down(prefill_worker: str) -> PeerDown:
    return PeerDown(worker=prefill_worker)
