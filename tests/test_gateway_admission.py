"""Admission by expected wait: a request the queue would hold past half its deadline gets 429."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from dsinfer.base.presets import resolve_model
from dsinfer.base.tokenizer import Tokenizer
from dsinfer.gateway.admission import MAX_WAIT_SHARE, QueueDrain
from dsinfer.gateway.app import build_app
from dsinfer.gateway.args import GatewayArgs
from dsinfer.gateway.backend import BackendMetrics, Capacity
from tests.fixtures.engine_backend import ScriptedBackend, serve, text_deltas


def test_rate_needs_enough_recent_starts() -> None:
    drain = QueueDrain(window=10.0, min_starts=4)
    for t in (0.0, 1.0, 2.0):
        drain.started(t)
    assert drain.rate(2.0) is None and drain.refusal(1000, 10.0, 2.0) is None  # too few to judge
    drain.started(3.0)
    assert drain.rate(3.0) == pytest.approx(4 / 3)
    assert drain.expected_wait(8, 4.0) == pytest.approx(8.0)  # 4 starts over 4 s
    assert drain.rate(13.5) is None  # the starts fell out of the window


def test_refusal_past_the_share_of_the_deadline() -> None:
    drain = QueueDrain(window=100.0, min_starts=2)
    for t in range(11):
        drain.started(float(t))  # 11 starts over 10 s; at t=10: 1.1 per second
    timeout = 40.0
    limit = timeout * MAX_WAIT_SHARE
    assert drain.refusal(int(1.1 * limit) - 1, timeout, 10.0) is None
    why, retry_after = drain.refusal(44, timeout, 10.0) or ("", 0.0)
    assert "44 requests are queued" in why and "--request-timeout" in why
    assert retry_after == pytest.approx(44 / 1.1 - limit)


class _QueuedBackend(ScriptedBackend):
    queued = 40

    def metrics_snapshot(self) -> BackendMetrics:
        return BackendMetrics(queue_length=self.queued, in_flight=self.queued, workers=[], ready=True)


def test_http_429_with_retry_after_when_the_queue_is_too_slow() -> None:
    tokenizer = Tokenizer.from_dir(resolve_model("tiny")[0])
    backend = _QueuedBackend(
        lambda job: text_deltas([[65]], n=job.params.n), capacity=Capacity(512, 64, {"colocated": 100})
    )
    app = build_app(backend, tokenizer, GatewayArgs(model="tiny", request_timeout=20.0), 4096)
    with serve(app) as url:
        ok = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert ok.status_code == 200  # no recent starts: only the count applies
        drain = app.state.gateway.queue_drain = QueueDrain()  # forget the start above
        now = time.monotonic()
        for i in range(20):  # one start a second over the last 20 s: 40 queued wait ~40 s > 10 s
            drain.started(now - 19.0 + i)
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert refused.status_code == 429, refused.text
        assert "would wait" in refused.json()["error"]["message"]
        assert 25 <= int(refused.headers["retry-after"]) <= 35
        backend.queued = 5  # a short queue is admitted again
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_an_idle_stretch_is_not_counted_as_slowness() -> None:
    drain = QueueDrain(window=100.0, min_starts=4)
    for t in range(10):
        drain.started(float(t))  # 10 starts over 9 s
    assert drain.refusal(0, 40.0, 30.0) is None  # the queue is empty at t=30: idle since
    for t in (31.0, 31.5):
        drain.started(t)
    assert drain.rate(32.0) is None  # two starts since the idle stretch: too few to judge
    for t in (32.5, 33.0):
        drain.started(t)
    assert drain.rate(34.0) == pytest.approx(4 / 4.0)  # 4 starts in the 4 s since t=30


def test_an_idle_gateway_collects_cycles_and_trims() -> None:
    """A refused request's error keeps its multi-MB body alive in a traceback cycle until the
    cyclic GC runs, which an idle gateway's few allocations never trigger: the idle trim does."""
    import gc
    import weakref
    from types import SimpleNamespace

    from dsinfer.gateway.idle import trim_when_idle

    class Holder:
        pass

    async def scenario() -> bool:
        ctx = SimpleNamespace(active_ids={"busy"})
        task = asyncio.create_task(trim_when_idle(ctx, every=0.01, growth=1 << 20))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        holder = Holder()
        holder.body, holder.me = b"x" * (64 << 20), holder  # 64 MiB, resident, in a cycle
        alive = weakref.ref(holder)
        del holder
        await asyncio.sleep(0.1)
        kept_while_busy = alive() is not None
        ctx.active_ids.clear()
        await asyncio.sleep(0.1)
        task.cancel()
        return kept_while_busy and alive() is None

    gc.disable()
    try:
        assert asyncio.run(scenario())
    finally:
        gc.enable()
