"""/v1/messages and /v1/responses bodies -> the chat completion request that serves them, the
Responses store, and the block events both stream (reasoning, text, tool calls)."""

from __future__ import annotations

import pytest

from dsinfer.gateway import anthropic_request, responses_request
from dsinfer.gateway.blocks import BlockStream
from dsinfer.gateway.choice import ChoiceUpdate
from dsinfer.gateway.errors import APIError
from dsinfer.gateway.responses_request import ResponseStore, StoredResponse
from dsinfer.gateway.tool_parsers import ToolCallDelta

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}


def test_messages_translation() -> None:
    req = anthropic_request.MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 9,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": ""},
                        {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Paris"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [{"type": "text", "text": "Sunny"}],
                        },
                        {"type": "text", "text": "Thanks"},
                    ],
                },
            ],
            "tools": [{"name": "w", "input_schema": SCHEMA}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "stop_sequences": ["END"],
            "thinking": {"type": "enabled", "budget_tokens": 100},
        }
    )
    chat = anthropic_request.to_chat_request(req)
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assistant = chat.messages[2]
    assert assistant.reasoning_content == "hmm" and assistant.tool_calls is not None
    assert assistant.tool_calls[0].function.arguments == '{"city": "Paris"}'
    assert chat.messages[3].tool_call_id == "t1" and chat.messages[3].content == "Sunny"
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.stop == ["END"] and chat.max_tokens == 9
    assert chat.chat_template_kwargs == {"thinking": True}
    assert chat.tools is not None and chat.tools[0].function.parameters == SCHEMA
    image = req.model_copy(
        update={
            "messages": [
                anthropic_request.AnthropicMessage.model_validate(
                    {"role": "user", "content": [{"type": "image"}]}
                )
            ]
        }
    )
    with pytest.raises(APIError, match="'image'"):
        anthropic_request.to_chat_request(image)


def test_responses_translation_and_store() -> None:
    req = responses_request.ResponsesRequest.model_validate(
        {
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
            ],
            "instructions": "Be brief.",
            "tools": [{"type": "function", "name": "w", "parameters": SCHEMA}],
            "tool_choice": {"type": "function", "name": "w"},
            "text": {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}},
            "max_output_tokens": 5,
        }
    )
    history = [{"role": "user", "content": "Earlier"}, {"role": "assistant", "content": "Yes"}]
    chat = responses_request.to_chat_request(req, history)
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "user", "assistant", "tool"]
    calls = chat.messages[4].tool_calls or []
    assert [c.id for c in calls] == ["c1", "c2"]
    assert chat.tool_choice is not None and chat.max_tokens == 5
    assert chat.response_format is not None and chat.response_format.type == "json_schema"
    with pytest.raises(APIError, match="web_search"):
        bad = req.model_copy(update={"tools": [responses_request.ResponseTool(type="web_search")]})
        responses_request.to_chat_request(bad, [])
    store = ResponseStore(capacity=2)
    for name in ("a", "b", "c"):
        store.put(name, StoredResponse([], {"id": name}))
    assert store.get("c").body == {"id": "c"}
    with pytest.raises(APIError, match="'a' is not stored") as info:
        store.get("a")
    assert info.value.status == 404


def test_block_stream_orders_reasoning_text_and_calls() -> None:
    blocks = BlockStream()
    events = blocks.feed(ChoiceUpdate(reasoning="think"))
    events += blocks.feed(ChoiceUpdate(text="Hi"))
    events += blocks.feed(
        ChoiceUpdate(tool_calls=[ToolCallDelta(0, id="c", name="w"), ToolCallDelta(0, "{}")])
    )
    events += blocks.finish()
    seen = [(e.action, e.block.kind, e.delta) for e in events]
    assert seen == [
        ("open", "reasoning", ""),
        ("delta", "reasoning", "think"),
        ("close", "reasoning", ""),
        ("open", "text", ""),
        ("delta", "text", "Hi"),
        ("close", "text", ""),
        ("open", "tool_call", ""),
        ("delta", "tool_call", "{}"),
        ("close", "tool_call", ""),
    ]
    assert [b.text for b in blocks.blocks] == ["think", "Hi", "{}"]
    empty = BlockStream()
    assert [(e.action, e.block.kind) for e in empty.finish()] == [("open", "text"), ("close", "text")]
