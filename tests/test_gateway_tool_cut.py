"""A tool call cut by max_tokens (issue 45): no partial marker in the content, streamed or not; the
answer is the text before the call, with finish_reason "length". Through a real uvicorn server (in
a thread) over a scripted backend that plays the default model's tokens of a DeepSeek-V3 tool call
up to max_tokens, as an engine would (tiny-chat spells a marker in about 20 byte tokens)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from dsinfer.base.presets import DEFAULT_MODEL, resolve_model
from dsinfer.base.protocol import TokenDelta
from dsinfer.base.tokenizer import Tokenizer
from dsinfer.gateway.app import build_app
from dsinfer.gateway.args import GatewayArgs
from dsinfer.gateway.backend import Capacity, Job
from dsinfer.gateway.tool_parsers.deepseek import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP
from tests.fixtures.engine_backend import ScriptedBackend, Step, serve

CONTENT = "Let me check."
ARGUMENTS = json.dumps({"city": "Paris"})
OUTPUT = f"{CONTENT}{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n{ARGUMENTS}\n```{CALL_END}{CALLS_END}"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model(DEFAULT_MODEL)[0])


@pytest.fixture(scope="module")
def output_ids(tokenizer: Tokenizer) -> list[int]:
    ids = tokenizer.encode(OUTPUT, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == OUTPUT
    return ids


@pytest.fixture(scope="module")
def url(tokenizer: Tokenizer, output_ids: list[int]) -> Iterator[str]:
    def script(job: Job) -> list[Step]:
        limit = job.params.max_tokens or len(output_ids)
        ids = output_ids[:limit]
        finish = "length" if limit < len(output_ids) else "stop"
        groups = [ids[i : i + 3] for i in range(0, len(ids), 3)]  # three tokens a step
        return [
            (
                0,
                TokenDelta(
                    request_id="", token_ids=group, finish_reason=finish if i == len(groups) - 1 else None
                ),
            )
            for i, group in enumerate(groups)
        ]

    backend = ScriptedBackend(script, capacity=Capacity(4096, 64, {"colocated": 1000}))
    with serve(build_app(backend, tokenizer, GatewayArgs(), tokenizer.vocab_size)) as base:
        yield base


def _tokens_up_to(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def _body(max_tokens: int | None, stream: bool) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS, "stream": stream}
    return body if max_tokens is None else {**body, "max_tokens": max_tokens}


def _whole(url: str, max_tokens: int | None) -> tuple[str | None, list[Any], str]:
    response = httpx.post(f"{url}/v1/chat/completions", json=_body(max_tokens, stream=False), timeout=30)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["message"]["content"], choice["message"].get("tool_calls") or [], choice["finish_reason"]


def _streamed(url: str, max_tokens: int | None) -> tuple[list[str], list[Any], str]:
    pieces, calls, finish = [], [], None
    body = _body(max_tokens, stream=True)
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line.removeprefix("data: "))["choices"][0]
            pieces.append(choice["delta"].get("content") or "")
            calls += choice["delta"].get("tool_calls") or []
            finish = choice["finish_reason"] or finish
    assert finish is not None
    return pieces, calls, finish


def test_a_whole_call(url: str) -> None:
    content, calls, finish = _whole(url, None)
    assert (content, finish) == (CONTENT, "tool_calls")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", ARGUMENTS)
    ]


def _cuts(tokenizer: Tokenizer) -> dict[str, int]:
    """max_tokens that cut the output at each place of the call."""
    before = _tokens_up_to(tokenizer, CONTENT)
    marker = _tokens_up_to(tokenizer, CONTENT + CALLS_BEGIN)
    header = _tokens_up_to(tokenizer, f"{CONTENT}{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_")
    args = _tokens_up_to(tokenizer, f"{CONTENT}{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n")
    assert before + 3 < marker and 16 in range(before + 1, marker)
    return {
        "marker's first token": before + 1,
        "16 tokens": 16,
        "marker's last token": marker - 1,
        "whole marker": marker,
        "header": header,
        "arguments": args + 4,
    }


@pytest.mark.parametrize(
    "where",
    ["marker's first token", "16 tokens", "marker's last token", "whole marker", "header", "arguments"],
)
def test_a_cut_call_is_the_text_before_it(url: str, tokenizer: Tokenizer, where: str) -> None:
    max_tokens = _cuts(tokenizer)[where]
    content, calls, finish = _whole(url, max_tokens)
    assert (content, calls, finish) == (CONTENT, [], "length")

    pieces, calls, finish = _streamed(url, max_tokens)
    assert "".join(pieces) == CONTENT and finish == "length"
    assert not any("<" in piece for piece in pieces), pieces
    if where != "arguments":
        assert calls == []
    # Cut inside its arguments, a streamed call was already sent in part (its name, some
    # arguments); finish_reason "length" says it is cut.
