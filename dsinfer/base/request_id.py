"""The one spelling of a worker request's id: ``"<request>/<choice>"``, ``"~<attempt>"`` appended
from the second attempt on.

``request`` is the id of the client's request (``cmpl-...``, ``chatcmpl-...``), ``choice`` the
OpenAI index of the choice within it (``prompt index x n + choice among n``) and ``attempt`` how
many times the choice was dispatched before (a choice sent again after its rank died, or moved to
another pool, is a new attempt: its id differs, so a late message of the old attempt never
mixes with the new one). Only :func:`format_request_id` writes such ids and only
:func:`parse_request_id` reads them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["RequestKey", "format_request_id", "parse_request_id"]

_ID = re.compile(r"(?P<request>.+)/(?P<choice>0|[1-9][0-9]*)(?:~(?P<attempt>[1-9][0-9]*))?")


@dataclass(frozen=True)
class RequestKey:
    request: str
    choice: int = 0
    attempt: int = 0

    def __post_init__(self) -> None:
        if not self.request:
            raise ValueError("request must not be empty")
        if self.choice < 0 or self.attempt < 0:
            raise ValueError(f"choice and attempt must be >= 0, got {self.choice}, {self.attempt}")

    def next_attempt(self) -> RequestKey:
        return RequestKey(self.request, self.choice, self.attempt + 1)


def format_request_id(key: RequestKey) -> str:
    suffix = f"~{key.attempt}" if key.attempt else ""
    return f"{key.request}/{key.choice}{suffix}"


def parse_request_id(request_id: str) -> RequestKey:
    """The key of a worker request id; ValueError for an id :func:`format_request_id` never writes."""
    match = _ID.fullmatch(request_id)
    if match is None:
        raise ValueError(f"{request_id!r} is not a worker request id ('<request>/<choice>[~<attempt>]')")
    attempt = match["attempt"]
    return RequestKey(match["request"], int(match["choice"]), int(attempt) if attempt else 0)
