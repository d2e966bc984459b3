"""A request's output constraint -> the grammar its workers enforce, or a 400 naming the problem.

Sources: OpenAI's ``response_format`` (``json_object``, ``json_schema``), vLLM's
``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) and its earlier
``guided_*`` names, and (chat) the tool-call grammar of ``tool_choice`` "required" or a named
function (dsinfer/gateway/tools.py). At most one may be given. The grammar is compiled here without
a tokenizer (llguidance's validator: schema errors, bad regexes, grammar syntax) so a bad one never
reaches a worker; the worker compiles the token-level matcher and caches it
(dsinfer/engine/constraints.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from dsinfer.base import grammar
from dsinfer.gateway.errors import APIError, bad_request
from dsinfer.gateway.openai_api import ChatCompletionRequest, CompletionRequest, ResponseFormat

Source = tuple[str, Callable[[], str]]  # (the parameter, what builds its grammar)


def parse_schema(value: dict[str, Any] | bool | str | None, param: str) -> dict[str, Any] | bool:
    """A JSON schema given as an object or as JSON text, or a 400 naming ``param``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise bad_request(f"{param}: the JSON schema is not valid JSON: {e}", param=param) from None
    if not isinstance(value, (dict, bool)):
        raise bad_request(f"{param}: a JSON schema must be an object", param=param)
    return value


def _response_format(rf: ResponseFormat) -> Source | None:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return "response_format", grammar.json_object
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise bad_request(
            "response_format of type json_schema needs json_schema.schema", param="response_format"
        )
    schema = parse_schema(rf.json_schema.schema_, "response_format.json_schema.schema")
    return "response_format", lambda: grammar.json_schema(schema)


def _choices(options: list[str], param: str) -> Source:
    if not options:
        raise bad_request(f"{param} must list at least one choice", param=param)
    return param, lambda: grammar.choice(options)


def _sources(req: CompletionRequest | ChatCompletionRequest) -> list[Source]:
    sources: list[Source] = []
    if req.response_format is not None:
        found = _response_format(req.response_format)
        if found is not None:
            sources.append(found)
    so = req.structured_outputs
    if so is not None:
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(so, name) is not None:
                raise bad_request(f"structured_outputs.{name} is not supported", param="structured_outputs")
        sources += _named("structured_outputs.", so.json_, so.regex, so.choice, so.grammar)
        if so.json_object:
            sources.append(("structured_outputs.json_object", grammar.json_object))
    sources += _named("guided_", req.guided_json, req.guided_regex, req.guided_choice, req.guided_grammar)
    return sources


def _named(
    prefix: str,
    schema: dict[str, Any] | bool | str | None,
    regex: str | None,
    choice: list[str] | None,
    lark: str | None,
) -> list[Source]:
    """The json, regex, choice and grammar constraints of one naming (``structured_outputs.json``
    or vLLM's earlier ``guided_json`` ...), in that order."""
    sources: list[Source] = []
    if schema is not None:
        checked_schema = parse_schema(schema, f"{prefix}json")
        sources.append((f"{prefix}json", lambda: grammar.json_schema(checked_schema)))
    if regex is not None:
        sources.append((f"{prefix}regex", lambda: grammar.regex(regex or "")))
    if choice is not None:
        sources.append(_choices(choice, f"{prefix}choice"))
    if lark is not None:
        sources.append((f"{prefix}grammar", lambda: grammar.from_lark(lark or "")))
    return sources


def request_grammar(
    req: CompletionRequest | ChatCompletionRequest,
    tool_grammar: str | None = None,
    tools_take_response_format: bool = False,
) -> str | None:
    """The one grammar the request's output must match, checked; None without a constraint.
    ``tools_take_response_format``: the tool grammar already allows the response format's answer."""
    sources = _sources(req)
    if tools_take_response_format:
        sources = [s for s in sources if s[0] != "response_format"]
    if tool_grammar is not None:
        sources.append(("tool_choice", lambda: tool_grammar))
    if not sources:
        return None
    if len(sources) > 1:
        names = ", ".join(name for name, _ in sources)
        raise bad_request(f"only one output constraint may be given, got {names}", param=sources[1][0])
    param, build = sources[0]
    return checked(build, param)


def checked(build: Callable[[], str], param: str) -> str:
    try:
        text = build()
    except ValueError as e:
        raise bad_request(f"{param}: {e}", param=param.split(".")[0]) from None
    problem = grammar.check(text)
    if problem is not None:
        raise APIError(400, f"{param}: {problem.strip()}", param=param.split(".")[0], code="invalid_grammar")
    return text
