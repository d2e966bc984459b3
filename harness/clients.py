"""OpenAI-style clients over httpx for benchmarks: a streamed completion whose every chunk is
timed (TTFT, TPOT, the gaps between tokens), a plain completion, and many of them at once.

A dropped connection before the first chunk, or an answer the OpenAI client would retry (408,
409, 429, 5xx), is sent again up to ``retries`` times after a doubling back-off, as the official
client does; once tokens have streamed, a drop ends the stream with its error (the tokens it
delivered are kept).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

RETRY_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504})
RETRY_BACKOFF = 0.5  # seconds before the first retry; doubled each time, at most RETRY_CAP
RETRY_CAP = 8.0


def completion_body(
    prompt: list[int] | str, max_tokens: int, *, model: str = "tiny", stream: bool = True, **extra: Any
) -> dict[str, Any]:
    """A greedy ``/v1/completions`` body that generates exactly ``max_tokens`` (``ignore_eos``)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    return {**body, **({"stream": True} if stream else {}), **extra}


@dataclass
class Stream:
    """What one streamed completion delivered. ``chunks``: (perf_counter time, tokens in it) of every
    chunk with a choice; the tokens are counted from its logprobs (ask ``logprobs=0``), else 0."""

    sent: float = field(default_factory=time.perf_counter)
    chunks: list[tuple[float, int]] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    request_id: str | None = None  # the completion's id, as the gateway's log names it
    error: str | None = None
    attempts: int = 0
    text: str = ""  # the choices' text (completions) or content (chat), concatenated

    @property
    def token_chunks(self) -> list[tuple[float, int]]:
        """The chunks that carried tokens."""
        return [c for c in self.chunks if c[1]]

    @property
    def ttft(self) -> float | None:
        """Send to the first chunk with a choice."""
        return self.chunks[0][0] - self.sent if self.chunks else None

    @property
    def e2e(self) -> float | None:
        """Send to the last chunk with a choice."""
        return self.chunks[-1][0] - self.sent if self.chunks else None

    @property
    def completion_tokens(self) -> int:
        """From the final usage chunk (``stream_options.include_usage``), else the counted tokens."""
        if self.usage is not None:
            return int(self.usage.get("completion_tokens", 0))
        return sum(n for _, n in self.chunks)

    @property
    def tpot(self) -> float | None:
        """(last chunk - first) / (tokens - 1)."""
        tokens = self.completion_tokens
        if len(self.chunks) < 1 or tokens < 2:
            return None
        return (self.chunks[-1][0] - self.chunks[0][0]) / (tokens - 1)

    def time_of_token(self, index: int) -> float | None:
        """When the chunk carrying output token ``index`` (0-based) arrived."""
        seen = 0
        for t, tokens in self.chunks:
            seen += tokens
            if seen > index:
                return t
        return None


def _read_chunk(out: Stream, data: str, now: float) -> None:
    chunk = json.loads(data)
    if "error" in chunk and out.error is None:
        out.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
    out.request_id = out.request_id or chunk.get("id")
    choices = chunk.get("choices") or []
    if choices:
        tokens = sum(len((c.get("logprobs") or {}).get("tokens") or []) for c in choices)
        out.chunks.append((now, tokens))
        out.text += "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in choices)
    if chunk.get("usage"):
        out.usage = chunk["usage"]


async def stream_completion(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    *,
    out: Stream | None = None,
    retries: int = 0,
    path: str = "/v1/completions",
) -> Stream:
    """POST ``body`` (``stream: true``) to ``url + path`` and read its server-sent events into
    ``out`` (a new ``Stream`` by default, sent now); never raises for HTTP or stream errors."""
    out = out or Stream()
    delay = RETRY_BACKOFF
    while True:
        out.attempts += 1
        retry = False
        try:
            async with client.stream("POST", f"{url}{path}", json=body) as resp:
                if resp.status_code != 200:
                    out.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                    retry = resp.status_code in RETRY_STATUSES
                else:
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        _read_chunk(out, line[len("data: ") :], time.perf_counter())
        except (httpx.TransportError, json.JSONDecodeError) as e:
            out.error = f"{type(e).__name__}: {e}"
            retry = isinstance(e, httpx.TransportError) and not out.chunks
        if not retry or out.attempts > retries:
            return out
        await asyncio.sleep(delay)
        delay = min(2 * delay, RETRY_CAP)
        out.error = None


async def complete(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], path: str = "/v1/completions"
) -> dict[str, Any]:
    """POST ``body`` (not streamed): the answer's JSON (raises on an HTTP error)."""
    response = await client.post(f"{url}{path}", json=body)
    response.raise_for_status()
    return dict(response.json())


async def stream_all(
    client: httpx.AsyncClient, url: str, bodies: Iterable[dict[str, Any]], retries: int = 0
) -> list[Stream]:
    """The streamed completions of ``bodies``, all sent at once."""
    return list(await asyncio.gather(*(stream_completion(client, url, b, retries=retries) for b in bodies)))


def client_for(concurrency: int, timeout: float = 600.0) -> httpx.AsyncClient:
    """An async client that keeps ``concurrency`` connections open, ``timeout`` s per request."""
    limits = httpx.Limits(max_connections=concurrency + 16, max_keepalive_connections=concurrency + 16)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout, connect=30.0))


def outcome(streams: list[Stream], seconds: float) -> dict[str, Any]:
    """How a run of ``streams`` over ``seconds`` ended: requests, failed, seconds, completed/s."""
    ok = sum(1 for s in streams if s.error is None)
    return {
        "requests": len(streams),
        "failed": len(streams) - ok,
        "seconds": seconds,
        "requests_per_s": ok / seconds,
    }
