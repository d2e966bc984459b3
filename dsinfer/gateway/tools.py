"""Chat tools: a request's ``tools`` and ``tool_choice`` -> what the template renders, whether the
output is read for tool calls, and the grammar that forces a call.

- ``none``: the tools are rendered (the model knows them) but the output is plain content.
- ``auto`` (the default with tools): the output is read with the server's tool-call parser
  (``--tool-call-parser``); calls become ``tool_calls`` and ``finish_reason`` "tool_calls".
- ``required`` / a named function: generation is constrained to the parser's format, one call
  (or several with ``parallel_tool_calls``) of the allowed function(s), with arguments valid under
  their parameter schema, so the output always parses, whatever the weights.
- ``auto`` with a JSON ``response_format``: the output is either calls (as under ``required``) or
  the answer in that format, so an agent's turn may call a tool or answer structured.

The legacy ``functions`` / ``function_call`` are refused with a 400 that names their replacement.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dsinfer.base.grammar import lark
from dsinfer.gateway.errors import bad_request
from dsinfer.gateway.openai_api import ChatCompletionRequest, ChatTool, NamedToolChoice
from dsinfer.gateway.structured import checked, parse_schema
from dsinfer.gateway.tool_parsers import ToolFormat, ToolSpec, tool_format


@dataclass(frozen=True)
class ToolPlan:
    template_tools: list[dict[str, Any]]  # the chat template's ``tools`` variable
    format: ToolFormat | None  # read the output for calls in this format (None: tool_choice none)
    grammar: str | None  # tool_choice required or named: the output must be a call
    with_response_format: bool = False  # the grammar also allows the response format's answer


def _answer(req: ChatCompletionRequest) -> str | None:
    """The Lark expression of a JSON ``response_format``'s answer; None for text or none."""
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return '%json {"type": "object"}'
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        return None  # the response format's own check names the problem
    schema = parse_schema(rf.json_schema.schema_, "response_format.json_schema.schema")
    return f"%json {json.dumps(schema, ensure_ascii=False)}"


def _spec(tool: ChatTool) -> ToolSpec:
    fn = tool.function
    parameters = fn.parameters if fn.parameters is not None else {"type": "object", "properties": {}}
    return ToolSpec(fn.name, parameters, fn.description)


def plan_tools(
    req: ChatCompletionRequest, parser: str, token_id: Callable[[str], int | None], thinking: bool = False
) -> ToolPlan | None:
    """``token_id``: a text's id when the vocabulary has it as one token (tool-call markers usually);
    ``thinking``: the prompt opens the thinking, so a forced call comes after it."""
    if req.functions is not None or req.function_call is not None:
        name = "functions" if req.functions is not None else "function_call"
        raise bad_request(
            f"{name} is deprecated and not supported; send tools and tool_choice instead", param=name
        )
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice != "none":
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    specs = [_spec(t) for t in req.tools]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct function names", param="tools")
    template_tools = [t.model_dump(exclude_none=True) for t in req.tools]
    if choice == "none":
        return ToolPlan(template_tools, None, None)
    fmt = tool_format(parser)
    if choice is None or choice == "auto":
        answer = _answer(req)
        if answer is None:
            return ToolPlan(template_tools, fmt, None)
        grammar = checked(
            lambda: lark(fmt.grammar(specs, req.parallel_tool_calls, token_id, thinking, answer)),
            "response_format",
        )
        return ToolPlan(template_tools, fmt, grammar, with_response_format=True)
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise bad_request(
                f"tool_choice names {choice.function.name!r}, which is not among the tools",
                param="tool_choice",
            )
        allowed = [s for s in specs if s.name == choice.function.name]
        parallel = False
    else:  # required
        allowed, parallel = specs, req.parallel_tool_calls
    grammar = checked(lambda: lark(fmt.grammar(allowed, parallel, token_id, thinking)), "tools")
    return ToolPlan(template_tools, fmt, grammar)
