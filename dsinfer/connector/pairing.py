"""The gateway's side of the handoff: a choice goes to a decode rank as DecodeAdmit naming its
prefill rank; the decode rank's KVDestination becomes the prefill rank's PrefillRequest, with the
decode rank's inbox and transfer agent. A dead prefill rank is announced to every decode rank
(PeerDown): the fence of every transfer from it."""

from __future__ import annotations

from dsinfer.base.protocol import Register, WorkerRequest
from dsinfer.connector.messages import DecodeAdmit, KVDestination, PeerDown, PrefillRequest


def decode_admit(request: WorkerRequest, prefill: Register) -> DecodeAdmit:
    """``request`` (its fields) as the decode rank's admission, paired with ``prefill``."""
    return DecodeAdmit(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        params=request.params,
        choice=request.choice,
        output_token_ids=request.output_token_ids,
        prefill_worker=prefill.worker,
        prefill_inbox=prefill.inbox,
    )


def prefill_request(admit: DecodeAdmit, dest: KVDestination, decode: Register) -> PrefillRequest | None:
    """The prefill rank's request for ``dest``, or None when ``dest`` is not from the decode rank
    the choice was admitted to (a late answer of an earlier attempt)."""
    if dest.request_id != admit.request_id or dest.worker != decode.worker:
        return None
    return PrefillRequest(
        request_id=admit.request_id,
        prompt_token_ids=admit.prompt_token_ids,
        params=admit.params,
        choice=admit.choice,
        output_token_ids=admit.output_token_ids,
        destination=dest,
        decode_inbox=decode.inbox,
        decode_agent=decode.transfer_agent,
        decode_transfer_metadata=decode.transfer_metadata,
    )


def peer_down(prefill_worker: str) -> PeerDown:
    return PeerDown(worker=prefill_worker)
