"""Reasoning parsers: split a chat completion's text into thinking (``reasoning_content``) and answer.

A parser is fed the text deltas of one choice in order and returns ``(reasoning, content)`` for
each; text that might be the start of a tag is held back until the next delta (or ``flush``),
so a tag split across deltas is still recognised and never leaks into either part.
"""

from __future__ import annotations

from typing import Protocol


class ReasoningParser(Protocol):
    def feed(self, text: str) -> tuple[str, str]: ...

    def flush(self) -> tuple[str, str]: ...


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class DeepSeekR1ReasoningParser:
    """DeepSeek-R1: everything up to ``</think>`` is thinking, the rest is the answer.

    R1 chat templates end the prompt with ``<think>\\n``, so the output usually starts inside
    the thinking without an opening tag; an opening ``<think>`` at the very start is dropped.
    Output without ``</think>`` is all thinking (the model was cut off before it answered).

    ``forced=False`` (``think-optional``): a reply thinks only when it opens with ``<think>``,
    otherwise it is all answer, as the built-in model replies (it thinks through a
    multiplication and answers the other tasks at once); SGLang's and vLLM's ``qwen3`` parser
    behaves so.
    """

    START = "<think>"
    END = "</think>"

    def __init__(self, forced: bool = True) -> None:
        self._forced = forced
        self._at_start = True
        self._thinking = True
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        buf = self._held + text
        self._held = ""
        if self._at_start:
            if len(buf) < len(self.START) and self.START.startswith(buf):
                self._held = buf
                return "", ""
            self._at_start = False
            if not self._forced and not buf.startswith(self.START):
                self._thinking = False
            buf = buf.removeprefix(self.START)
        if not self._thinking:
            return "", buf
        end = buf.find(self.END)
        if end >= 0:
            self._thinking = False
            return buf[:end], buf[end + len(self.END) :]
        keep = _partial_suffix(buf, self.END)
        if keep:
            self._held = buf[-keep:]
            buf = buf[:-keep]
        return buf, ""

    def flush(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self._at_start and not self._forced:
            self._thinking = False
        self._at_start = False
        return (held, "") if self._thinking else ("", held)


class DeepSeekV3ReasoningParser:
    """DeepSeek-V3.1, V3.2 and V4: thinking is a per-request mode of the chat template
    (``chat_template_kwargs: {"thinking": true}``, as vLLM and SGLang take it). A thinking prompt
    ends with ``<think>`` and the output parses as R1's; otherwise the prompt ends with ``</think>``
    and the whole output is the answer."""

    def __init__(self, thinking: bool) -> None:
        self._thinking = DeepSeekR1ReasoningParser() if thinking else None

    def feed(self, text: str) -> tuple[str, str]:
        return ("", text) if self._thinking is None else self._thinking.feed(text)

    def flush(self) -> tuple[str, str]:
        return ("", "") if self._thinking is None else self._thinking.flush()


PARSERS = ("think-optional", "deepseek-r1", "deepseek-v3.1", "deepseek-v3.2", "deepseek-v4")


def make_reasoning_parser(name: str | None, thinking: bool = False) -> ReasoningParser | None:
    """The parser ``name`` for one choice; ``thinking``: the request asked for thinking mode."""
    if name is None:
        return None
    if name == "deepseek-r1":
        return DeepSeekR1ReasoningParser()
    if name == "think-optional":
        return DeepSeekR1ReasoningParser(forced=False)
    if name in ("deepseek-v3.1", "deepseek-v3.2", "deepseek-v4"):
        return DeepSeekV3ReasoningParser(thinking)
    raise ValueError(f"unknown reasoning parser {name!r} (choose from {', '.join(PARSERS)})")
