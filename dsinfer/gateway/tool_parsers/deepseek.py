"""DeepSeek-V3/R1 and DeepSeek-V3.1 tool calls (V3.2-Exp's template writes V3.1's).

V3 and R1 (the released chat templates and DeepSeek's function-calling guide)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    ARGS
    ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

V3.1 drops the type and the code fence::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
"""

from __future__ import annotations

from collections.abc import Callable

from dsinfer.gateway.tool_parsers.base import ToolFormat, ToolSpec, new_call_id

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
TOKENS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)


class DeepSeekV3Format(ToolFormat):
    name = "deepseek-v3"
    section_begin, section_end = CALLS_BEGIN, CALLS_END
    call_begin = CALL_BEGIN
    args_begin = "\n```json\n"
    args_end = "\n```" + CALL_END
    tokens = TOKENS

    def parse_header(self, header: str, index: int) -> tuple[str, str]:
        return header.rpartition(SEP)[2].strip(), new_call_id()

    def header_for(self, tool: ToolSpec, text: Callable[[str], str]) -> str:
        return text(f"function{SEP}{tool.name}")


class DeepSeekV31Format(ToolFormat):
    name = "deepseek-v3.1"
    section_begin, section_end = CALLS_BEGIN, CALLS_END
    call_begin = CALL_BEGIN
    args_begin = SEP
    args_end = CALL_END
    tokens = TOKENS

    def parse_header(self, header: str, index: int) -> tuple[str, str]:
        return header.strip(), new_call_id()

    def header_for(self, tool: ToolSpec, text: Callable[[str], str]) -> str:
        return text(tool.name)


DEEPSEEK_V3 = DeepSeekV3Format()
DEEPSEEK_V31 = DeepSeekV31Format()
