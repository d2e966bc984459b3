"""Server-sent events as the OpenAI API streams them: ``data: <json>\\n\\n``, then ``data: [DONE]``."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

DONE = "data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: BaseModel | dict[str, Any]) -> str:
    body = data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data, ensure_ascii=False)
    return f"data: {body}\n\n"
