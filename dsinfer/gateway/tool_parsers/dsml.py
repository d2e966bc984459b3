"""DeepSeek-V3.2's and V4's DSML tool calls (the V3.2 release's encoding; V3.2-Exp wrote V3.1's)::

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true">raw text</｜DSML｜parameter>
    <｜DSML｜parameter name="KEY" string="false">JSON value</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

An invoke may also hold the arguments as one JSON object. Arguments become JSON when the invoke
ends (a parameter's value is only known whole), so they arrive in one delta per call.

DeepSeek-V4 names the block ``tool_calls`` and writes it after a blank line; its constrained calls
are written as parameters, the way the model was trained to (dsinfer/base/chat_v4.py), and a
malformed call is returned as text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from dsinfer.base.chat_v4 import DSML, TOOL_CALLS_BEGIN, TOOL_CALLS_END
from dsinfer.gateway.tool_parsers.base import ToolFormat, ToolSpec, compact_schema, new_call_id

_PARAMETER = re.compile(
    rf'<{DSML}parameter\s+name="([^"]*)"\s+string="(true|false)"\s*>(.*?)</{DSML}parameter>', re.DOTALL
)


class DeepSeekV32Format(ToolFormat):
    name = "deepseek-v3.2"
    section_begin = f"<{DSML}function_calls>"
    section_end = f"</{DSML}function_calls>"
    call_begin = f"<{DSML}invoke name="
    args_begin = ">"
    args_end = f"</{DSML}invoke>"
    stream_arguments = False
    tokens = (DSML,)

    def parse_header(self, header: str, index: int) -> tuple[str, str]:
        return header.strip().strip('"'), new_call_id()

    def header_for(self, tool: ToolSpec, text: Callable[[str], str]) -> str:
        return text(json.dumps(tool.name))

    def arguments_json(self, raw: str) -> str:
        body = raw.strip()
        if body.startswith("{"):
            try:
                return json.dumps(json.loads(body), ensure_ascii=False)
            except json.JSONDecodeError:
                pass
        arguments: dict[str, Any] = {}
        for key, is_string, value in _PARAMETER.findall(raw):
            if is_string == "true":
                arguments[key] = value
                continue
            try:
                arguments[key] = json.loads(value)
            except json.JSONDecodeError:
                arguments[key] = value
        return json.dumps(arguments, ensure_ascii=False)


DEEPSEEK_V32 = DeepSeekV32Format()


class DeepSeekV4Format(DeepSeekV32Format):
    name = "deepseek-v4"
    section_begin, section_end = TOOL_CALLS_BEGIN, TOOL_CALLS_END
    lead = "\n\n"
    gap = "\n"
    malformed_as_text = True

    def arguments_rules(self, rule: str, tool: ToolSpec, text: Callable[[str], str]) -> list[str]:
        """One line per parameter, required ones first (as the schema lists them), then any of
        the optional ones in order; a string's value is raw text without ``<`` (one of its
        ``enum``, at most ``maxLength`` characters), any other value JSON under its schema. No
        properties: no parameters; no ``properties`` at all (any object): one JSON object."""
        schema = tool.parameters or {}
        if "properties" not in schema:
            return super().arguments_rules(rule, tool, text)
        properties: dict[str, Any] = schema["properties"] or {}
        newline = text("\n")
        if not properties:
            return [f"{rule}: {newline} {newline}"]
        required = [k for k in schema.get("required", []) if k in properties]
        optional = [k for k in properties if k not in required]
        names = {key: f"{rule}_{j}" for j, key in enumerate([*required, *optional])}
        if required:
            body = f" {newline} ".join(names[k] for k in required)
            body += "".join(f" ({newline} {names[k]})?" for k in optional)
        else:
            runs = [
                names[k] + "".join(f" ({newline} {names[later]})?" for later in optional[j + 1 :])
                for j, k in enumerate(optional)
            ]
            body = "(" + " | ".join(f"({run})" for run in runs) + ")?"
        lines = [f"{rule}: {newline} {body} {newline}"]
        for key, name in names.items():
            prop = properties[key] if isinstance(properties[key], dict) else {}
            is_string = prop.get("type") == "string"
            opening = text(f'<{DSML}parameter name="{key}" string="{"true" if is_string else "false"}">')
            value = (
                _raw_string(prop, text)
                if is_string
                else f"%json {json.dumps(compact_schema(prop), ensure_ascii=False)}"
            )
            lines.append(f"{name}: {opening} {value} {text(f'</{DSML}parameter>')}")
        return lines


def _raw_string(schema: dict[str, Any], text: Callable[[str], str]) -> str:
    """The Lark expression of a string parameter's raw value."""
    enum = [v for v in schema.get("enum") or [] if isinstance(v, str)]
    if enum:
        return "(" + " | ".join(text(v) if v else '""' for v in enum) + ")"
    longest = schema.get("maxLength")
    if isinstance(longest, int) and longest >= 0:
        return f"/[^<]{{0,{longest}}}/" if longest else '""'
    return "/[^<]+/?"


DEEPSEEK_V4 = DeepSeekV4Format()
