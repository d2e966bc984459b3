"""What every tool-call format shares: the calls, the streaming parser over begin/end markers, and
the grammar of a valid call.

The formats DeepSeek and Kimi models write are all a *section* (begin marker ... end marker) of
*calls*, each ``call begin, header, args begin, arguments, args end``; the header names the
function (and, for Kimi, is the call's id). ``MarkerParser`` walks that shape incrementally: text
outside a section is content; a marker split across deltas is held back until it is complete, so
no marker leaks into the content and arguments stream as they are generated. A section that
never ended is dropped, and so is a call that never ended when the output was cut (by max_tokens:
``flush(cut=True)``), with the start of a marker held back at the cut: the answer is the text
before it. An output that ended by itself inside a call keeps the call and the arguments it got,
except in a format that returns malformed calls as text (``malformed_as_text``): there the text
of the section from its last complete call on is the answer's, with a log line.

A format may write a ``lead`` before its section (DeepSeek-V4's blank line): it is part of the
section's marker when present, and the grammar writes it.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dsinfer.base.grammar import JSON_OPTIONS, lark_string

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
END_THINK = "</think>"  # where a thinking prompt's reasoning ends (DeepSeek's and Kimi's)
log = logging.getLogger("dsinfer.gateway")


@dataclass(frozen=True)
class ToolSpec:
    """A function the model may call (OpenAI's ``tools[].function``)."""

    name: str
    parameters: dict[str, Any] = field(default_factory=lambda: dict(EMPTY_PARAMETERS))
    description: str | None = None


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class ToolCallDelta:
    """A piece of the call at ``index``: its first delta has the id and the name."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ToolFormat(ABC):
    """One model family's tool-call text: its markers, how a header names a call, its grammar."""

    name: str
    section_begin: str
    section_end: str
    call_begin: str
    args_begin: str
    args_end: str
    stream_arguments = True  # False: the arguments are converted at the call's end (DSML)
    needs_special_tokens = False  # markers are special tokens the detokenizer would skip
    tokens: tuple[str, ...] = ()  # the markers a vocabulary may have as single tokens
    lead = ""  # written before section_begin; dropped from the content when present
    gap = ""  # what the grammar writes between the section's markers and its calls
    malformed_as_text = False  # True: an unfinished call at the end is returned as text

    @abstractmethod
    def parse_header(self, header: str, index: int) -> tuple[str, str]:
        """-> (function name, call id) of the call at ``index``."""

    @abstractmethod
    def header_for(self, tool: ToolSpec, text: Callable[[str], str]) -> str:
        """The Lark expression the grammar writes between call begin and args begin (``text``
        writes a literal)."""

    def arguments_json(self, raw: str) -> str:
        """The arguments as JSON text (formats whose arguments are not JSON convert them here)."""
        return raw

    def parser(self) -> MarkerParser:
        return MarkerParser(self)

    def parse(self, text: str, cut: bool = False) -> tuple[str, list[ToolCall]]:
        """A whole output (``cut``: stopped by a length limit) -> (content, calls)."""
        parser = self.parser()
        content, _ = parser.feed(text)
        rest, _ = parser.flush(cut)
        return content + rest, parser.calls

    def grammar(
        self,
        tools: list[ToolSpec],
        parallel: bool,
        token_id: Callable[[str], int | None],
        thinking: bool = False,
        answer: str | None = None,
    ) -> str:
        """Lark (llguidance's dialect): one section of one call (or several when ``parallel``) of
        one of ``tools``, with arguments valid under the tool's parameter schema. A marker the
        vocabulary has as one token (``token_id``) is written as that token (``<[id]>``), which
        is how the model emits it and how llguidance matches it. ``thinking``: the prompt opened
        the model's thinking, which runs free until ``</think>`` before the call (any text when
        the vocabulary has ``</think>`` as one token, else text without ``<``). ``answer``: a Lark
        expression the output may be instead of the calls (a response format's JSON)."""
        single = {t: i for t in self.tokens if (i := token_id(t)) is not None}

        def text(literal: str) -> str:
            if not single:
                return lark_string(literal)
            pieces = re.split(
                "(" + "|".join(map(re.escape, sorted(single, key=len, reverse=True))) + ")", literal
            )
            return " ".join(f"<[{single[p]}]>" if p in single else lark_string(p) for p in pieces if p)

        gap = f" {text(self.gap)} " if self.gap else " "
        end_think = token_id(END_THINK) if thinking else None
        thought = (
            f"thought <[{end_think}]> " if end_think is not None else f"thought {lark_string(END_THINK)} "
        )
        section = f"{text(self.lead + self.section_begin)}{gap}calls{gap}{text(self.section_end)}"
        body = f"(({section}) | answer)" if answer is not None else section
        lines = [
            f"start: {thought if thinking else ''}{body}",
            f"calls: call ({gap.strip()} call)*"
            if parallel and self.gap
            else "calls: call+"
            if parallel
            else "calls: call",
            "call: " + " | ".join(f"call_{i}" for i in range(len(tools))),
        ]
        for i, tool in enumerate(tools):
            lines.append(
                f"call_{i}: {text(self.call_begin)} {self.header_for(tool, text)} "
                f"{text(self.args_begin)} args_{i} {text(self.args_end)}"
            )
            lines.extend(self.arguments_rules(f"args_{i}", tool, text))
        if thinking:
            lines.append("thought: /(?s:.*)/" if end_think is not None else "thought: /[^<]*/")
        if answer is not None:
            lines.append(f"answer: {answer}")
        return "\n".join(lines) + "\n"

    def arguments_rules(self, rule: str, tool: ToolSpec, text: Callable[[str], str]) -> list[str]:
        """The Lark rules of a call's arguments, ``rule`` first: one JSON object by default."""
        return [f"{rule}: %json {json.dumps(compact_schema(tool.parameters), ensure_ascii=False)}"]


def compact_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with llguidance's options for compact JSON (dsinfer/base/grammar.py)."""
    out = copy.deepcopy(schema) if schema else dict(EMPTY_PARAMETERS)
    out["x-guidance"] = {**out.get("x-guidance", {}), **JSON_OPTIONS}
    return out


class ToolParser(ABC):
    calls: list[ToolCall]

    @abstractmethod
    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """The next text of the output -> (content, tool-call deltas)."""

    @abstractmethod
    def flush(self, cut: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """The output ended (``cut``: by a length limit): whatever was held back."""


_TEXT, _SECTION, _HEADER, _ARGS, _AFTER = range(5)


class MarkerParser(ToolParser):
    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.calls = []
        self._buf = ""
        self._state = _TEXT
        self._args = ""  # the current call's raw arguments (formats that convert them at the end)
        self._raw = ""  # the section's text since its begin or its last complete call
        self._section_calls = 0  # calls completed in the current section

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            before, state = self._buf, self._state
            moved = self._advance(content, deltas)
            if state not in (_TEXT, _AFTER):  # the buffer only loses a prefix in a section
                self._raw += before[: len(before) - len(self._buf)]
            if state == _ARGS and self._state == _SECTION:
                self._raw, self._section_calls = "", self._section_calls + 1
            if not moved:
                return "".join(content), deltas

    def flush(self, cut: bool = False) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = "", []
        if not cut and self.fmt.malformed_as_text and self._unfinished():
            if self._state == _ARGS:
                self.calls.pop()  # its arguments were never sent: they convert at the call's end
            content = self._raw + self._buf
            log.warning("%s tool-call text is malformed or unfinished; returned as content", self.fmt.name)
        elif self._state == _AFTER or (self._state == _TEXT and not cut):
            content = self._buf  # in _TEXT: what could have begun a section (held back)
        elif self._state == _ARGS and cut:
            self.calls.pop()  # streamed, its deltas are sent already; the finish reason tells
        elif self._state == _ARGS:
            deltas = self._arguments(self._buf, last=True)
        self._buf = ""
        return content, deltas

    def _unfinished(self) -> bool:
        if self._state in (_HEADER, _ARGS):
            return True
        return self._state == _SECTION and self._section_calls == 0

    def _advance(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        """One transition if the buffer allows it; False when it must wait for more text."""
        fmt, buf = self.fmt, self._buf
        if self._state in (_TEXT, _AFTER):
            at = buf.find(fmt.section_begin) if self._state == _TEXT else -1
            if at < 0:
                keep = 0
                if self._state == _TEXT:
                    keep = max(
                        _partial_suffix(buf, m) for m in (fmt.section_begin, fmt.lead + fmt.section_begin)
                    )
                content.append(buf[: len(buf) - keep])
                self._buf = buf[len(buf) - keep :]
                return False
            before = buf[:at]
            lead = fmt.lead if fmt.lead and before.endswith(fmt.lead) else ""
            content.append(before[: len(before) - len(lead)])
            self._buf, self._state = buf[at + len(fmt.section_begin) :], _SECTION
            self._raw, self._section_calls = lead + fmt.section_begin, 0
            return True
        if self._state == _SECTION:
            stripped = buf.lstrip()
            for marker, state in ((fmt.call_begin, _HEADER), (fmt.section_end, _AFTER)):
                if stripped.startswith(marker):
                    self._buf, self._state = stripped[len(marker) :], state
                    return True
            if any(m.startswith(stripped) for m in (fmt.call_begin, fmt.section_end)):
                self._buf = stripped
                return False
            nearest = [i for i in (stripped.find(fmt.call_begin), stripped.find(fmt.section_end)) if i > 0]
            if nearest:  # stray text before a marker: dropped
                self._buf = stripped[min(nearest) :]
                return True
            # stray text: dropped, but for what may be the start of a marker (the rest comes next)
            keep = max(_partial_suffix(stripped, m) for m in (fmt.call_begin, fmt.section_end))
            self._buf = stripped[len(stripped) - keep :]
            return False
        if self._state == _HEADER:
            at = buf.find(fmt.args_begin)
            if at < 0:
                return False
            index = len(self.calls)
            name, call_id = fmt.parse_header(buf[:at], index)
            self.calls.append(ToolCall(call_id, name, ""))
            self._buf, self._state, self._args = buf[at + len(fmt.args_begin) :], _ARGS, ""
            if fmt.stream_arguments:
                deltas.append(ToolCallDelta(index, id=call_id, name=name))
            return True
        at = buf.find(fmt.args_end)
        if at < 0:
            keep = _partial_suffix(buf, fmt.args_end)
            deltas.extend(self._arguments(buf[: len(buf) - keep], last=False))
            self._buf = buf[len(buf) - keep :]
            return False
        deltas.extend(self._arguments(buf[:at], last=True))
        self._buf, self._state = buf[at + len(fmt.args_end) :], _SECTION
        return True

    def _arguments(self, piece: str, last: bool) -> list[ToolCallDelta]:
        call, index = self.calls[-1], len(self.calls) - 1
        if self.fmt.stream_arguments:
            call.arguments += piece
            return [ToolCallDelta(index, arguments=piece)] if piece else []
        self._args += piece
        if not last:
            return []
        call.arguments = self.fmt.arguments_json(self._args)
        return [ToolCallDelta(index, id=call.id, name=call.name, arguments=call.arguments)]
