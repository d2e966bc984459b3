"""DeepSeek-V3.2's DSML tool calls (the V3.2 release's encoding; V3.2-Exp wrote V3.1's)::

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true">raw text</｜DSML｜parameter>
    <｜DSML｜parameter name="KEY" string="false">JSON value</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

An invoke may also hold the arguments as one JSON object. Arguments become JSON when the invoke
ends (a parameter's value is only known whole), so they arrive in one delta per call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from dsinfer.gateway.tool_parsers.base import ToolFormat, ToolSpec, new_call_id

DSML = "｜DSML｜"
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
