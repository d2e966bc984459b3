"""Kimi-K2 tool calls (its released chat template; the header is the call's id)::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>ARGS
    <|tool_call_end|>...<|tool_calls_section_end|>

The markers are special tokens of Kimi's tokenizer, so the text must be detokenized with them.
"""

from __future__ import annotations

from collections.abc import Callable

from dsinfer.gateway.tool_parsers.base import ToolFormat, ToolSpec

MAX_INDEX_DIGITS = 5  # call indices up to 99,999 in one conversation


class KimiK2Format(ToolFormat):
    name = "kimi-k2"
    section_begin = "<|tool_calls_section_begin|>"
    section_end = "<|tool_calls_section_end|>"
    call_begin = "<|tool_call_begin|>"
    args_begin = "<|tool_call_argument_begin|>"
    args_end = "<|tool_call_end|>"
    needs_special_tokens = True
    tokens = (section_begin, section_end, call_begin, args_begin, args_end)

    def parse_header(self, header: str, index: int) -> tuple[str, str]:
        call_id = header.strip()
        name = call_id.rpartition(":")[0] if ":" in call_id else call_id
        return name.removeprefix("functions."), call_id

    def header_for(self, tool: ToolSpec, text: Callable[[str], str]) -> str:
        # The index counts the conversation's calls; bounded, so that a forced call cannot spend
        # max_tokens on digits (a sampled random-weight model did, and never reached its arguments).
        return f"{text(f'functions.{tool.name}:')} /[0-9]{{1,{MAX_INDEX_DIGITS}}}/"


KIMI_K2 = KimiK2Format()
