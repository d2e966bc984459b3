"""DeepSeek-V4's chat encoding: a conversation -> the prompt text the model was trained on.

V4 ships no Jinja template; its checkpoints carry a Python encoder (``encoding/encoding_dsv4.py``).
This module writes the same text from that encoder's observed behaviour (the golden cases in
tests/data/v4_chat_goldens.json are its output):

- ``BOS``, then each message; a user turn opens with ``<｜User｜>`` and is followed, when an
  assistant turn comes next or the conversation ends, by ``<｜Assistant｜>`` and ``<think>``
  (thinking mode, current turn) or ``</think>`` (chat mode, or a past turn whose thinking is
  dropped). An assistant turn is ``[reasoning</think>]content[tool calls]<｜end▁of▁sentence｜>``.
- There is no tool role: tool results join the user turn that follows the assistant's calls as
  ``<tool_result>...</tool_result>`` blocks, ordered as the calls were, blocks joined by a blank
  line; consecutive user messages join the same way.
- Tools are described after the first system (or developer) message's text; calls are DSML
  (``<｜DSML｜tool_calls>`` of ``invoke``s of ``parameter``s, see ``TOOLS_PROMPT``).
- Thinking of past turns is dropped (``drop_thinking``) unless a message defines tools; a
  developer message before the last user turn is dropped with it.
- ``reasoning_effort="max"`` in thinking mode puts ``MAX_EFFORT_PROMPT`` before everything.

Messages are dicts in OpenAI's shape (``role``, ``content``, ``reasoning_content``,
``tool_calls``, ``tool_call_id``), with ``tools`` (OpenAI's list) on a system or developer message.
"""

from __future__ import annotations

import json
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
DSML = "｜DSML｜"
TOOL_CALLS_BEGIN, TOOL_CALLS_END = f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"
EFFORTS = ("high", "max")

MAX_EFFORT_PROMPT = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve "
    "the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and "
    "adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

TOOLS_PROMPT = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "{TOOL_CALLS_BEGIN}" block like the following:

{TOOL_CALLS_BEGIN}
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
{TOOL_CALLS_END}

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete reasoning inside {THINK}...{END_THINK} BEFORE any tool calls or final response.

Otherwise, output directly after {END_THINK} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


class ChatEncodingError(ValueError):
    """A conversation V4's encoding cannot express; the message names the message at fault."""


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def tools_prompt(tools: list[dict[str, Any]]) -> str:
    """The tools section: each function's schema as one JSON line."""
    functions = [tool.get("function", tool) for tool in tools]
    return TOOLS_PROMPT.replace("{schemas}", "\n".join(_json(f) for f in functions))


def dsml_parameters(arguments: str | dict[str, Any]) -> str:
    """A call's arguments as DSML parameters: strings as they are, other values as JSON. Arguments
    that are not a JSON object become one string parameter named ``arguments``."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            parsed = None
        arguments = parsed if isinstance(parsed, dict) else {"arguments": arguments}
    lines = []
    for key, value in arguments.items():
        is_string = isinstance(value, str)
        text = value if is_string else _json(value)
        lines.append(
            f'<{DSML}parameter name="{key}" string="{"true" if is_string else "false"}">{text}</{DSML}parameter>'
        )
    return "\n".join(lines)


def dsml_tool_calls(calls: list[dict[str, Any]]) -> str:
    """OpenAI ``tool_calls`` as the DSML block an assistant turn ends with."""
    invokes = []
    for call in calls:
        function = call.get("function", call)
        body = dsml_parameters(function.get("arguments") or "{}")
        invokes.append(f'<{DSML}invoke name="{function["name"]}">\n{body}\n</{DSML}invoke>')
    return f"{TOOL_CALLS_BEGIN}\n" + "\n".join(invokes) + f"\n{TOOL_CALLS_END}"


def _turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool results and consecutive user messages folded into user turns of ``blocks``
    (("text", str) or ("result", call id, str)), results in their calls' order."""
    turns: list[dict[str, Any]] = []
    call_order: dict[str, int] = {}
    for message in messages:
        role = message.get("role")
        if role in ("tool", "user"):
            block = (
                ("result", message.get("tool_call_id") or "", _text(message.get("content")))
                if role == "tool"
                else ("text", _text(message.get("content")))
            )
            if turns and turns[-1]["role"] == "user":
                turns[-1]["blocks"].append(block)
            else:
                turns.append({"role": "user", "blocks": [block], "order": call_order})
            continue
        if role == "assistant" and message.get("tool_calls"):
            call_order = {c["id"]: i for i, c in enumerate(message["tool_calls"]) if c.get("id")}
        turns.append(dict(message))
    return turns


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):  # OpenAI content parts: the text ones, in order
        return "\n\n".join(
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    return str(content)


def _user_text(turn: dict[str, Any]) -> str:
    blocks, order = turn["blocks"], turn["order"]
    results = [b for b in blocks if b[0] == "result"]
    if len(results) > 1 and order:
        results = iter(sorted(results, key=lambda b: order.get(b[1], 0)))
        blocks = [next(results) if b[0] == "result" else b for b in blocks]
    return "\n\n".join(b[1] if b[0] == "text" else f"<tool_result>{b[2]}</tool_result>" for b in blocks)


def _last_user(turns: list[dict[str, Any]]) -> int:
    return max((i for i, t in enumerate(turns) if t["role"] in ("user", "developer")), default=-1)


def _drop_past_thinking(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    last = _last_user(turns)
    kept = []
    for i, turn in enumerate(turns):
        if i >= last or turn["role"] in ("user", "system"):
            kept.append(turn)
        elif turn["role"] == "assistant":
            kept.append({k: v for k, v in turn.items() if k != "reasoning_content"})
    return kept


def _system_text(turn: dict[str, Any], opener: str) -> str:
    text = opener + _text(turn.get("content"))
    if turn.get("tools"):
        text += "\n\n" + tools_prompt(turn["tools"])
    return text


def encode_v4(
    messages: list[dict[str, Any]],
    thinking: bool = False,
    reasoning_effort: str | None = None,
    drop_thinking: bool = True,
) -> str:
    """The prompt for ``messages``; when the last turn is a user's, it ends with the assistant's
    opening (``<｜Assistant｜><think>`` or ``</think>``)."""
    if reasoning_effort is not None and reasoning_effort not in EFFORTS:
        raise ChatEncodingError(
            f"reasoning_effort must be one of {', '.join(EFFORTS)}, got {reasoning_effort!r}"
        )
    turns = _turns(messages)
    keep_thinking = not drop_thinking or any(t.get("tools") for t in turns)
    if thinking and not keep_thinking:
        turns = _drop_past_thinking(turns)
    last_user = _last_user(turns)
    out = [BOS]
    if thinking and reasoning_effort == "max" and turns:
        out.append(MAX_EFFORT_PROMPT)
    for i, turn in enumerate(turns):
        role = turn["role"]
        if role == "system":
            out.append(_system_text(turn, ""))
        elif role == "developer":
            if not _text(turn.get("content")):
                raise ChatEncodingError(f"messages.{i}: a developer message must have content")
            out.append(_system_text(turn, USER))
        elif role == "user":
            out.append(USER + _user_text(turn))
        elif role == "assistant":
            reasoning = ""
            if thinking and (keep_thinking or i > last_user):
                reasoning = _text(turn.get("reasoning_content")) + END_THINK
            calls = "\n\n" + dsml_tool_calls(turn["tool_calls"]) if turn.get("tool_calls") else ""
            out.append(reasoning + _text(turn.get("content")) + calls + EOS)
        else:
            raise ChatEncodingError(f"messages.{i}: role {role!r} is not supported by DeepSeek-V4's encoding")
        next_role = turns[i + 1]["role"] if i + 1 < len(turns) else "assistant"
        if role in ("user", "developer") and next_role == "assistant":
            opens_thinking = thinking and (keep_thinking or i >= last_user)
            out.append(ASSISTANT + (THINK if opens_thinking else END_THINK))
    return "".join(out)


def render_v4_chat(
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    thinking: bool = False,
    reasoning_effort: str | None = None,
    drop_thinking: bool = True,
    **unused: Any,
) -> str:
    """An API request's conversation: the request's ``tools`` go with the first message, made a
    system message when it is not one (as SGLang and vLLM call the encoder). Other keyword
    arguments (a Jinja template's variables) are ignored."""
    messages = [dict(m) for m in messages]
    if not messages or messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": ""})
    if tools:
        messages[0]["tools"] = tools
    text = encode_v4(messages, thinking, reasoning_effort, drop_thinking)
    if not add_generation_prompt:
        for opening in (ASSISTANT + THINK, ASSISTANT + END_THINK):
            text = text.removesuffix(opening)
    return text
