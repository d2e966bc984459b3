"""Tool-call parsers: a model's tool-call text -> OpenAI ``tool_calls``, streamed or whole.

``--tool-call-parser NAME`` picks one per server; ``PARSERS`` maps each name to the module that
defines it, imported on first use. A parser is made per choice (``make_tool_parser``), fed the
choice's answer text in order and returns what is plain content and what is tool-call deltas;
``parse`` does the same for a whole text. Each format also writes the Lark grammar of a valid
call (``ToolFormat.grammar``), which constrains generation for ``tool_choice`` "required" or a
named function so that the output always parses to calls with schema-valid arguments.
"""

from __future__ import annotations

import importlib

from dsinfer.gateway.tool_parsers.base import ToolCall, ToolCallDelta, ToolFormat, ToolParser, ToolSpec

__all__ = ["PARSERS", "ToolCall", "ToolCallDelta", "ToolFormat", "ToolParser", "ToolSpec", "tool_format"]

PARSERS: dict[str, str] = {
    "deepseek-v3": "dsinfer.gateway.tool_parsers.deepseek:DEEPSEEK_V3",  # V3, R1, R1-0528
    "deepseek-v3.1": "dsinfer.gateway.tool_parsers.deepseek:DEEPSEEK_V31",
    "deepseek-v3.2": "dsinfer.gateway.tool_parsers.dsml:DEEPSEEK_V32",  # V3.2's DSML
    "deepseek-v4": "dsinfer.gateway.tool_parsers.dsml:DEEPSEEK_V4",  # V4's DSML
    "kimi-k2": "dsinfer.gateway.tool_parsers.kimi:KIMI_K2",
}


def tool_format(name: str) -> ToolFormat:
    """The format registered as ``name`` (its module is imported now)."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r} (choose from {', '.join(PARSERS)})")
    module, attribute = PARSERS[name].split(":")
    found: ToolFormat = getattr(importlib.import_module(module), attribute)
    return found
