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

CASES: list[dict[str, Any]] = [
    {
        "name": "chat_single_turn",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}],
        "thinking_mode": "chat",
    },
    {
        "name": "thinking_single_turn",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1=?"}],
        "thinking_mode": "thinking",
    },
    {
        "name": "no_system_chat",
        "messages": [{"role": "user", "content": "Wie geht's? 你好"}],
        "thinking_mode": "chat",
    },
    {
        "name": "chat_history",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "Hi!", "reasoning_content": "a greeting"},
            {"role": "user", "content": "1+1=?"},
        ],
        "thinking_mode": "chat",
    },
    {
        "name": "thinking_history_dropped",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "Hi!", "reasoning_content": "a greeting"},
            {"role": "user", "content": "1+1=?"},
            {"role": "assistant", "content": "2", "reasoning_content": "one and one"},
            {"role": "user", "content": "and 2+2?"},
        ],
        "thinking_mode": "thinking",
    },
    {
        "name": "thinking_history_kept",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "Hi!", "reasoning_content": "a greeting"},
            {"role": "user", "content": "1+1=?"},
        ],
        "thinking_mode": "thinking",
        "drop_thinking": False,
    },
    {
        "name": "reasoning_effort_max",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Prove it."}],
        "thinking_mode": "thinking",
        "reasoning_effort": "max",
    },
    {
        "name": "reasoning_effort_max_no_system",
        "messages": [{"role": "user", "content": "Prove it."}],
        "thinking_mode": "thinking",
        "reasoning_effort": "max",
    },
    {
        "name": "reasoning_effort_high",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Prove it."}],
        "thinking_mode": "thinking",
        "reasoning_effort": "high",
    },
    {
        "name": "reasoning_effort_max_in_chat_mode",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Prove it."}],
        "thinking_mode": "chat",
        "reasoning_effort": "max",
    },
    {
        "name": "tools_first_turn_chat",
        "messages": [
            {"role": "system", "content": "You help.", "tools": [WEATHER, SEARCH]},
            {"role": "user", "content": "Weather in Paris?"},
        ],
        "thinking_mode": "chat",
    },
    {
        "name": "tools_first_turn_thinking",
        "messages": [
            {"role": "system", "content": "", "tools": [WEATHER]},
            {"role": "user", "content": "Weather in Paris?"},
        ],
        "thinking_mode": "thinking",
    },
    {
        "name": "tools_round_trip_thinking",
        "messages": [
            {"role": "system", "content": "You help.", "tools": [WEATHER, SEARCH]},
            {"role": "user", "content": "Weather in Paris, and Rome's old town?"},
            {"role": "assistant", "content": "", "reasoning_content": "two tools", "tool_calls": TWO_CALLS},
            {"role": "tool", "tool_call_id": "call_b", "content": "Rome: many results"},
            {"role": "tool", "tool_call_id": "call_a", "content": '{"sky": "clear", "c": 21}'},
        ],
        "thinking_mode": "thinking",
    },
    {
        "name": "tools_round_trip_chat_then_answer",
        "messages": [
            {"role": "system", "content": "You help.", "tools": [WEATHER]},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "Let me check.",
                "tool_calls": [_call("call_1", "get_weather", '{"city": "Paris"}')],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "assistant", "content": "It is sunny in Paris."},
            {"role": "user", "content": "Thanks! And tomorrow?"},
        ],
        "thinking_mode": "chat",
    },
    {
        "name": "tools_history_thinking_kept",
        "messages": [
            {"role": "system", "content": "You help.", "tools": [WEATHER]},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "call the tool",
                "tool_calls": [_call("call_1", "get_weather", '{"city": "Paris"}')],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "assistant", "content": "Sunny.", "reasoning_content": "read the result"},
            {"role": "user", "content": "And Rome?"},
        ],
        "thinking_mode": "thinking",
    },
    {
        "name": "tool_result_then_user_text",
        "messages": [
            {"role": "system", "content": "", "tools": [WEATHER]},
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [_call("c1", "get_weather", '{"city": "Oslo"}')],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "snow"},
            {"role": "user", "content": "Answer in French."},
        ],
        "thinking_mode": "chat",
    },
    {
        "name": "arguments_not_json",
        "messages": [
            {"role": "system", "content": "", "tools": [WEATHER]},
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [_call("c1", "get_weather", "Oslo, 3 days")]},
            {"role": "tool", "tool_call_id": "c1", "content": "snow"},
        ],
        "thinking_mode": "chat",
    },
    {
        "name": "ends_with_assistant",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "Hi!", "reasoning_content": "a greeting"},
        ],
        "thinking_mode": "thinking",
    },
    {
        "name": "developer_with_tools",
        "messages": [
            {"role": "developer", "content": "Use tools when useful.", "tools": [SEARCH]},
            {"role": "user", "content": "Find the news."},
        ],
        "thinking_mode": "thinking",
    },
    {
        "name": "two_system_messages",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "system", "content": "Answer in English."},
            {"role": "user", "content": "hello"},
        ],
        "thinking_mode": "chat",
    },
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
