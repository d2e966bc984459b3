"""PD decode role: the KV connector's decode side (dsinfer/connector/decode.py) behind the
control plane, then decoding as any rank does.

DecodeAdmit, PrefillDone, TransferProgress, TransferAborted and PeerDown go to the connector; an
Abort ends the request wherever it is (waiting for its KV, or running in the engine).
"""

from __future__ import annotations

import logging

from dsinfer.base.protocol import Abort, TokenDelta
from dsinfer.connector.decode import DecodeConnector
from dsinfer.connector.messages import (
    AnyMessage,
    DecodeAdmit,
    PeerDown,
    PrefillDone,
    TransferAborted,
    TransferProgress,
)
from dsinfer.connector.outbox import Outbox
from dsinfer.engine.facade import EngineFacade
from dsinfer.workers.role import ConnectedWorker, abort_running, token_delta

log = logging.getLogger("dsinfer.worker")


class DecodeWorker(ConnectedWorker):
    role = "decode"
    connector: DecodeConnector

    def __init__(
        self,
        engine: EngineFacade,
        outbox: Outbox,
        worker: str,
        incarnation: str,
        *,
        inbox: str,
        transfer_timeout: float,
        quarantine: float,
    ) -> None:
        super().__init__(engine, outbox, worker, incarnation)
        self.connector = DecodeConnector(
            engine,
            outbox,
            worker,
            self.fail,
            inbox=inbox,
            transfer_timeout=transfer_timeout,
            quarantine=quarantine,
            stages=self.stages,
        )

    def handle(self, message: AnyMessage, now: float) -> None:
        if isinstance(message, DecodeAdmit):
            if not self.refuse_if_draining(message):
                self.connector.admit(message, now)
        elif isinstance(message, PrefillDone):
            joined = self.connector.done(message)
            if joined is not None:
                self.outbox.send_gateway(token_delta(joined.update, joined.num_cached_tokens))
                if joined.update.finish_reason is not None:
                    self.stages.end(message.request_id, finish=joined.update.finish_reason)
        elif isinstance(message, TransferProgress):
            self.connector.progress(message, now)
        elif isinstance(message, TransferAborted):
            self.connector.fenced(message.request_id)
        elif isinstance(message, Abort):
            if not self.connector.abort(message.request_id, now):
                abort_running(self.engine, self.outbox, message.request_id)
            else:
                self.outbox.send_gateway(TokenDelta(request_id=message.request_id, finish_reason="abort"))
            self.stages.end(message.request_id, finish="abort")
        elif isinstance(message, PeerDown):
            self.connector.peer_down(message.worker)
        else:
            log.warning("decode worker ignored %s", type(message).__name__)

    def num_queued_elsewhere(self) -> int:
        return self.connector.num_waiting()
