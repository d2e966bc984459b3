"""An idle rank gathers a burst of requests before its first step only while the gateway says more
are coming (``WorkerRequest.more_coming``): a lone request starts at once, a burst starts in one
prefill, and a burst whose last request went elsewhere ends after ``BURST_GAP_MS`` of silence."""

from __future__ import annotations

import time

from dsinfer.base.protocol import GenerateRequest, Heartbeat
from dsinfer.base.sampling_params import SamplingParams
from dsinfer.connector.messages import AnyMessage
from dsinfer.workers.step_loop import BURST_GAP_MS, burst_continues, rest_of_burst


def _request(name: str, more_coming: bool) -> GenerateRequest:
    return GenerateRequest(
        request_id=name, prompt_token_ids=[1, 2], params=SamplingParams(seed=1), more_coming=more_coming
    )


class ScriptedChannel:
    """``receive`` hands out the scripted batches in order; past them, it waits out its timeout."""

    def __init__(self, batches: list[list[AnyMessage]]) -> None:
        self.batches = batches
        self.waited_ms = 0

    def receive(self, timeout_ms: int) -> list[AnyMessage]:
        if self.batches:
            return self.batches.pop(0)
        time.sleep(timeout_ms / 1000)
        self.waited_ms += timeout_ms
        return []


def test_only_a_request_that_says_more_are_coming_continues_a_burst() -> None:
    assert not burst_continues([])
    assert not burst_continues([Heartbeat(worker="w", incarnation="i")])
    assert not burst_continues([_request("a", False)])
    assert burst_continues([_request("a", True)])
    assert not burst_continues([_request("a", True), _request("b", False)])  # the newest one counts
    assert burst_continues([_request("a", True), Heartbeat(worker="w", incarnation="i")])


def test_the_burst_ends_at_the_request_that_says_it_is_the_last() -> None:
    last, next_burst = _request("c", False), _request("d", True)
    channel = ScriptedChannel(
        [[_request("b", True)], [Heartbeat(worker="w", incarnation="i")], [last], [next_burst]]
    )
    gathered = rest_of_burst(channel)  # type: ignore[arg-type]
    assert [getattr(m, "request_id", "hb") for m in gathered] == ["b", "hb", "c"]
    assert channel.batches == [[next_burst]] and channel.waited_ms == 0  # no wait for a gap


def test_a_burst_whose_last_request_never_comes_ends_after_a_gap() -> None:
    channel = ScriptedChannel([[_request("b", True)]])
    started = time.monotonic()
    gathered = rest_of_burst(channel)  # type: ignore[arg-type]
    assert [m.request_id for m in gathered] == ["b"]  # type: ignore[union-attr]
    assert channel.waited_ms == BURST_GAP_MS and time.monotonic() - started < 5
