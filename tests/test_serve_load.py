"""No request fails for being queued (issue: accepted requests died of a KV-transfer timeout while
they waited their turn in the prefill queue): the all-in-one server (the built-in model, one
prefill and one decode pool, KV over NIXL) with a short --kv-transfer-timeout takes bursts of
concurrent prompts of about 1,400 tokens (30, doubled until one waits past twice the timeout)
and then 300 concurrent short streams: every stream ends with its tokens and a finish reason, or
with a 429 before it started; none ends with an error."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest

from harness.server import serve

pytestmark = pytest.mark.system

TIMEOUT = 6.0  # --kv-transfer-timeout: its floor (3 progress reports); the long prompts queue far longer


async def _stream(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> tuple[str, float]:
    """-> ("ok" | "429" | "error: ...", seconds to the stream's end)."""
    body = {
        "model": "tiny-chat",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    start = time.monotonic()
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code == 429:
            return "429", time.monotonic() - start
        if response.status_code != 200:
            return f"error: HTTP {response.status_code} {(await response.aread())[:200]!r}", 0.0
        finish, tokens = None, 0
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return f"error: {event['error']}", time.monotonic() - start
            for choice in event.get("choices", []):
                tokens += 1
                finish = choice.get("finish_reason") or finish
        if finish is None:
            return "error: the stream ended without a finish reason", time.monotonic() - start
        return "ok", time.monotonic() - start


async def _burst(base_url: str, prompts: list[list[int]], max_tokens: int) -> list[tuple[str, float]]:
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        return await asyncio.gather(*(_stream(client, p, max_tokens) for p in prompts))


def test_queued_prompts_outlive_the_transfer_timeout(tmp_path: Path) -> None:
    args = ["--kv-transfer-timeout", str(TIMEOUT), "--max-num-batched-tokens", "512"]
    with serve(args, tmp_path) as server:
        # The queue must outlast the timeout on any machine: a faster one gets a larger burst.
        count, slowest = 30, 0.0
        while slowest <= 2 * TIMEOUT:
            assert count <= 240, (
                f"even {count // 2} long prompts kept none queued past the timeout ({slowest:.1f} s)"
            )
            long_prompts = [[(7 * i + j) % 290 + 10 for j in range(1400)] for i in range(count)]
            results = asyncio.run(_burst(server.base_url, long_prompts, max_tokens=4))
            slowest = max(seconds for _, seconds in results)
            failed = [outcome for outcome, _ in results if outcome not in ("ok", "429")]
            assert not failed, (
                f"{len(failed)} of {count} long prompts failed: {failed[:3]}\n{server.log()[-3000:]}"
            )
            count *= 2
        short_prompts = [[(11 * i + j) % 290 + 10 for j in range(24)] for i in range(300)]
        results = asyncio.run(_burst(server.base_url, short_prompts, max_tokens=16))
        failed = [outcome for outcome, _ in results if outcome not in ("ok", "429")]
        assert not failed, f"{len(failed)} of 300 streams failed: {failed[:3]}\n{server.log()[-3000:]}"
        assert sum(outcome == "ok" for outcome, _ in results) >= 200
