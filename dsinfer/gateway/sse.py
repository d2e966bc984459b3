"""Server-sent events as the OpenAI API streams them: ``data: <json>\\n\\n``, then ``data: [DONE]``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from pydantic import BaseModel

from dsinfer.gateway.choice import ChoiceUpdate
from dsinfer.gateway.errors import error_body
from dsinfer.gateway.openai_api import Usage
from dsinfer.gateway.request_run import RequestRun, RequestTimeout

DONE = "data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: BaseModel | dict[str, Any]) -> str:
    body = data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data, ensure_ascii=False)
    return f"data: {body}\n\n"


def named_event(event: str, data: dict[str, Any]) -> str:
    """A typed event, as /v1/responses and Anthropic's /v1/messages stream them."""
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def run_events(
    run: RequestRun,
    chunk: Callable[[int, ChoiceUpdate], BaseModel | None],
    usage_chunk: Callable[[Usage], BaseModel],
    head: Iterable[BaseModel] = (),
) -> AsyncIterator[str]:
    """A run's stream: ``head``, the chunk of every update that makes one, the usage chunk if the
    request asked for it, DONE. A failed choice or the deadline ends it with an error event and DONE."""
    for item in head:
        yield sse(item)
    try:
        async for index, update in run.updates():
            if update.error is not None:
                await run.abort()
                yield sse(error_body(update.error, type="server_error", code="internal_error"))
                yield DONE
                return
            data = chunk(index, update)
            if data is not None:
                yield sse(data)
    except RequestTimeout as e:
        yield sse(error_body(str(e), type="timeout_error", code="timeout"))
        yield DONE
        return
    if run.prepared.include_usage:
        yield sse(usage_chunk(run.usage()))
    yield DONE
