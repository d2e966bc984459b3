"""PD prefill role: the KV connector's prefill side (dsinfer/connector/prefill.py) behind the
control plane. PrefillRequest and Abort go to the connector; each step runs with its per-layer
write hook."""

from __future__ import annotations

import logging

from dsinfer.base.protocol import Abort
from dsinfer.connector.messages import PROGRESS_INTERVAL, AnyMessage, PrefillRequest
from dsinfer.connector.outbox import Outbox
from dsinfer.connector.prefill import PrefillConnector
from dsinfer.engine.agreement import StepVotes
from dsinfer.engine.facade import EngineFacade
from dsinfer.engine.step import StepPlan
from dsinfer.transfer.base import TransferBackend
from dsinfer.workers.role import ConnectedWorker

log = logging.getLogger("dsinfer.worker")


class PrefillWorker(ConnectedWorker):
    role = "prefill"
    connector: PrefillConnector

    def __init__(
        self,
        engine: EngineFacade,
        outbox: Outbox,
        worker: str,
        incarnation: str,
        transfer: TransferBackend,
        *,
        quarantine: float,
        progress_interval: float = PROGRESS_INTERVAL,
    ) -> None:
        super().__init__(engine, outbox, worker, incarnation)
        self.connector = PrefillConnector(
            engine,
            outbox,
            transfer,
            self.fail,
            quarantine=quarantine,
            progress_interval=progress_interval,
            stages=self.stages,
        )

    def handle(self, message: AnyMessage, now: float) -> None:
        if isinstance(message, PrefillRequest):
            if not self.refuse_if_draining(message):
                self.connector.start(message)
        elif isinstance(message, Abort):
            self.connector.abort(message, now)
        else:
            log.warning("prefill worker ignored %s", type(message).__name__)

    def step(self, plan: StepPlan, agreed: StepVotes) -> None:
        self.connector.stepped(self.engine.run_step(plan, agreed, self.connector.layer_hook_for))

    def step_interrupted(self) -> None:
        self.connector.step_interrupted()

    def num_queued_elsewhere(self) -> int:
        return self.connector.num_done_waiting()
