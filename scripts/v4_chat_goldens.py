"""Record DeepSeek-V4's chat encoding of a set of conversations: tests/data/v4_chat_goldens.json.

The expected strings come from DeepSeek's released encoder (``encoding/encoding_dsv4.py`` of the
DeepSeek-V4 checkpoints), as SGLang vendors it unchanged in behaviour: this script downloads the
``sglang==0.5.12`` wheel (no dependencies), imports its ``encoding_dsv4`` module from a temporary
directory and runs ``encode_messages`` on every case below. Nothing of it is kept but its
output; dsinfer's own encoder (dsinfer/base/chat_v4.py) is tested against that output.

The cases are written in the encoder's own input format: tools on a system message,
``thinking_mode`` "chat" or "thinking", ``reasoning_effort`` None, "high" or "max".

Usage: python scripts/v4_chat_goldens.py [--out tests/data/v4_chat_goldens.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

ORACLE_WHEEL = "sglang==0.5.12"
ORACLE_MEMBER = "sglang/srt/entrypoints/openai/encoding_dsv4.py"
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "v4_chat_goldens.json"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web; résumé of the results",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "filters": {"type": "object"}},
        },
    },
}


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


TWO_CALLS = [
    _call("call_a", "get_weather", '{"city": "Paris", "days": 2}'),
    _call(
        "call_b",
        "search",
        '{"query": "Rome \\"old\\" town", "filters": {"lang": ["it", "en"], "safe": true}}',
    ),
]


def _case(name: str, mode: str, *messages: dict[str, Any], **options: Any) -> dict[str, Any]:
    return {"name": name, "messages": list(messages), "thinking_mode": mode, **options}


def _msg(role: str, content: str, **fields: Any) -> dict[str, Any]:
    return {"role": role, "content": content, **fields}


def _called(
    call_id: str, arguments: str, result: str, content: str = "", **fields: Any
) -> list[dict[str, Any]]:
    """An assistant turn calling get_weather, and the tool's result."""
    call = _msg("assistant", content, tool_calls=[_call(call_id, "get_weather", arguments)], **fields)
    return [call, {"role": "tool", "tool_call_id": call_id, "content": result}]


BRIEF = _msg("system", "Be brief.")
HELLO = [_msg("user", "hello"), _msg("assistant", "Hi!", reasoning_content="a greeting")]
PROVE = _msg("user", "Prove it.")
HELPER = _msg("system", "You help.", tools=[WEATHER])
BARE = _msg("system", "", tools=[WEATHER])
PARIS = _msg("user", "Weather in Paris?")

CASES: list[dict[str, Any]] = [
    _case("chat_single_turn", "chat", BRIEF, _msg("user", "hello")),
    _case("thinking_single_turn", "thinking", BRIEF, _msg("user", "1+1=?")),
    _case("no_system_chat", "chat", _msg("user", "Wie geht's? 你好")),
    _case("chat_history", "chat", BRIEF, *HELLO, _msg("user", "1+1=?")),
    _case(
        "thinking_history_dropped",
        "thinking",
        BRIEF,
        *HELLO,
        _msg("user", "1+1=?"),
        _msg("assistant", "2", reasoning_content="one and one"),
        _msg("user", "and 2+2?"),
    ),
    _case("thinking_history_kept", "thinking", BRIEF, *HELLO, _msg("user", "1+1=?"), drop_thinking=False),
    _case("reasoning_effort_max", "thinking", BRIEF, PROVE, reasoning_effort="max"),
    _case("reasoning_effort_max_no_system", "thinking", PROVE, reasoning_effort="max"),
    _case("reasoning_effort_high", "thinking", BRIEF, PROVE, reasoning_effort="high"),
    _case("reasoning_effort_max_in_chat_mode", "chat", BRIEF, PROVE, reasoning_effort="max"),
    _case("tools_first_turn_chat", "chat", _msg("system", "You help.", tools=[WEATHER, SEARCH]), PARIS),
    _case("tools_first_turn_thinking", "thinking", BARE, PARIS),
    _case(
        "tools_round_trip_thinking",
        "thinking",
        _msg("system", "You help.", tools=[WEATHER, SEARCH]),
        _msg("user", "Weather in Paris, and Rome's old town?"),
        _msg("assistant", "", reasoning_content="two tools", tool_calls=TWO_CALLS),
        {"role": "tool", "tool_call_id": "call_b", "content": "Rome: many results"},
        {"role": "tool", "tool_call_id": "call_a", "content": '{"sky": "clear", "c": 21}'},
    ),
    _case(
        "tools_round_trip_chat_then_answer",
        "chat",
        HELPER,
        PARIS,
        *_called("call_1", '{"city": "Paris"}', "sunny", "Let me check."),
        _msg("assistant", "It is sunny in Paris."),
        _msg("user", "Thanks! And tomorrow?"),
    ),
    _case(
        "tools_history_thinking_kept",
        "thinking",
        HELPER,
        PARIS,
        *_called("call_1", '{"city": "Paris"}', "sunny", reasoning_content="call the tool"),
        _msg("assistant", "Sunny.", reasoning_content="read the result"),
        _msg("user", "And Rome?"),
    ),
    _case(
        "tool_result_then_user_text",
        "chat",
        BARE,
        _msg("user", "Weather?"),
        *_called("c1", '{"city": "Oslo"}', "snow"),
        _msg("user", "Answer in French."),
    ),
    _case(
        "arguments_not_json", "chat", BARE, _msg("user", "Weather?"), *_called("c1", "Oslo, 3 days", "snow")
    ),
    _case("ends_with_assistant", "thinking", BRIEF, *HELLO),
    _case(
        "developer_with_tools",
        "thinking",
        _msg("developer", "Use tools when useful.", tools=[SEARCH]),
        _msg("user", "Find the news."),
    ),
    _case("two_system_messages", "chat", BRIEF, _msg("system", "Answer in English."), _msg("user", "hello")),
]


def load_oracle(workdir: Path) -> Any:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(workdir), ORACLE_WHEEL],
        check=True,
    )
    wheel = next(workdir.glob("sglang-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        source = workdir / "encoding_dsv4.py"
        source.write_bytes(archive.read(ORACLE_MEMBER))
    spec = importlib.util.spec_from_file_location("released_encoding_dsv4", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        oracle = load_oracle(Path(tmp))
        records = []
        for case in CASES:
            expected = oracle.encode_messages(
                json.loads(json.dumps(case["messages"])),
                thinking_mode=case["thinking_mode"],
                drop_thinking=case.get("drop_thinking", True),
                reasoning_effort=case.get("reasoning_effort"),
            )
            records.append({**case, "expected": expected})
            print(f"{case['name']}: {len(expected)} characters", flush=True)
    document = {
        "source": f"encode_messages of DeepSeek-V4's released encoder as vendored in the {ORACLE_WHEEL} wheel "
        f"({ORACLE_MEMBER}); written by scripts/v4_chat_goldens.py",
        "cases": records,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {len(records)} cases to {args.out}")


if __name__ == "__main__":
    main()
