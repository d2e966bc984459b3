"""DeepSeek-V4's conversation surface: its chat encoder, DSML tool calls and reasoning modes.

The encoder's golden strings (tests/data/v4_chat_goldens.json) are the output of DeepSeek's
released encoder (``encoding_dsv4.py``, as vendored in the sglang 0.5.12 wheel), recorded by
scripts/v4_chat_goldens.py: chat and thinking modes, history thinking dropped and kept, each
reasoning effort, tools, parallel tool calls and their results (reordered as the calls were),
developer messages. dsinfer's encoder must write the same text, token for token.

End to end, a tiny V4 checkpoint (harness/v4_checkpoints.py) served by ``dsinfer serve`` finishes
two-round tool-calling conversations through the official ``openai`` client (chat completions,
Responses) and the ``anthropic`` client (/v1/messages), constrained to emit a valid call, streamed
and not alike; its thinking mode splits the output into reasoning and content.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import llguidance
import openai
import pytest

from dsinfer.base.chat_v4 import (
    ASSISTANT,
    END_THINK,
    MAX_EFFORT_PROMPT,
    THINK,
    dsml_tool_calls,
    encode_v4,
    render_v4_chat,
)
from dsinfer.base.presets import RANDOM_MODEL, resolve_model
from dsinfer.base.tokenizer import ChatTemplateError, Tokenizer
from dsinfer.engine.constraints import GrammarCache
from dsinfer.gateway.app import with_chat_template
from dsinfer.gateway.args import GatewayArgs
from dsinfer.gateway.errors import APIError
from dsinfer.gateway.openai_api import ChatCompletionRequest
from dsinfer.gateway.prepare import reasoning_mode
from dsinfer.gateway.reasoning import make_reasoning_parser
from dsinfer.gateway.responses_request import input_messages
from dsinfer.gateway.structured import request_grammar
from dsinfer.gateway.tool_parsers import ToolSpec, tool_format
from dsinfer.gateway.tools import plan_tools
from harness.server import Server, serve
from harness.v4_checkpoints import build_v4

GOLDENS = json.loads((Path(__file__).parent / "data" / "v4_chat_goldens.json").read_text(encoding="utf-8"))
V4 = tool_format("deepseek-v4")
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
}
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["sunny", "rainy"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}}
]


@pytest.fixture(scope="module")
def tiny_tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model(RANDOM_MODEL)[0])


@pytest.mark.parametrize("case", GOLDENS["cases"], ids=[c["name"] for c in GOLDENS["cases"]])
def test_encoder_equals_the_released_encoder(case: dict[str, Any], tiny_tokenizer: Tokenizer) -> None:
    text = encode_v4(
        case["messages"],
        case["thinking_mode"] == "thinking",
        case.get("reasoning_effort"),
        case.get("drop_thinking", True),
    )
    assert text == case["expected"]
    encode = tiny_tokenizer.encode
    assert encode(text, add_special_tokens=False) == encode(case["expected"], add_special_tokens=False)


def test_goldens_cover_every_mode() -> None:
    cases = GOLDENS["cases"]
    assert {c["thinking_mode"] for c in cases} == {"chat", "thinking"}
    assert {c.get("reasoning_effort") for c in cases} == {None, "high", "max"}
    assert any(c.get("drop_thinking") is False for c in cases)
    assert any(m.get("tools") for c in cases for m in c["messages"])
    assert any(m["role"] == "tool" for c in cases for m in c["messages"])
    assert any(len(m.get("tool_calls") or []) > 1 for c in cases for m in c["messages"])
    assert "released encoder" in GOLDENS["source"]


def test_request_tools_go_with_a_system_message() -> None:
    ask = [{"role": "user", "content": "Weather?"}]
    text = render_v4_chat(ask, tools=TOOLS)
    assert text == encode_v4([{"role": "system", "content": "", "tools": TOOLS}, *ask])
    assert text.endswith(ASSISTANT + END_THINK) and '"name": "get_weather"' in text
    thinking = render_v4_chat(ask, thinking=True, reasoning_effort="max")
    assert thinking.endswith(ASSISTANT + THINK) and MAX_EFFORT_PROMPT in thinking
    assert render_v4_chat(ask, add_generation_prompt=False).endswith("Weather?")


def test_encoder_refuses_what_it_cannot_write() -> None:
    with pytest.raises(ValueError, match="reasoning_effort"):
        encode_v4([{"role": "user", "content": "x"}], True, "medium")
    with pytest.raises(ValueError, match=r"messages\.1: role 'critic'"):
        encode_v4([{"role": "user", "content": "x"}, {"role": "critic", "content": "y"}])


def test_a_v4_checkpoint_chooses_the_encoder(tmp_path: Path, tiny_tokenizer: Tokenizer) -> None:
    """config.json's model_type picks the encoder (the checkpoint's chat_template.jinja is not V4's
    format); --chat-template replaces it as it replaces a template; V3 keeps its template."""
    build_v4("flash_like", tmp_path, with_tokenizer=True)
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer.chat_encoder == "deepseek-v4"
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages, thinking=True) == render_v4_chat(messages, thinking=True)
    with pytest.raises(ChatTemplateError, match="not supported"):
        tokenizer.apply_chat_template([{"role": "critic", "content": "x"}])
    template = tmp_path / "override.jinja"
    template.write_text("{{ messages[0]['content'] }}!", encoding="utf-8")
    assert with_chat_template(tokenizer, template).apply_chat_template(messages) == "hi!"
    assert tiny_tokenizer.chat_encoder is None
    args = GatewayArgs()
    assert (args.reasoning_parser, args.tool_call_parser) == ("auto", "auto")
    v4 = args.for_chat_encoder("deepseek-v4")
    assert (v4.reasoning_parser, v4.tool_call_parser) == ("deepseek-v4", "deepseek-v4")
    plain = args.for_chat_encoder(None)
    assert (plain.reasoning_parser, plain.tool_call_parser) == ("think-optional", "deepseek-v3")
    chosen = GatewayArgs(tool_call_parser="deepseek-v3.2").for_chat_encoder("deepseek-v4")
    assert chosen.tool_call_parser == "deepseek-v3.2"


@pytest.mark.parametrize(
    ("fields", "mode"),
    [
        ({}, (False, None)),
        ({"chat_template_kwargs": {"thinking": True}}, (True, None)),
        ({"chat_template_kwargs": {"enable_thinking": True}}, (True, None)),
        ({"reasoning_effort": "none"}, (False, None)),
        ({"reasoning_effort": "low"}, (True, "high")),
        ({"reasoning_effort": "medium"}, (True, "high")),
        ({"reasoning_effort": "high"}, (True, "high")),
        ({"reasoning_effort": "xhigh"}, (True, "max")),
        ({"reasoning_effort": "max"}, (True, "max")),
        ({"reasoning_effort": "max", "chat_template_kwargs": {"thinking": False}}, (False, None)),
        ({"chat_template_kwargs": {"reasoning_effort": "max"}}, (True, "max")),
    ],
)
def test_reasoning_mode_of_a_request(fields: dict[str, Any], mode: tuple[bool, str | None]) -> None:
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **fields})
    assert reasoning_mode(req) == mode


def test_unknown_reasoning_effort_is_a_400() -> None:
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "extreme"}
    )
    with pytest.raises(APIError, match="reasoning_effort must be one of") as info:
        reasoning_mode(req)
    assert info.value.status == 400


def test_responses_reasoning_items_become_the_next_assistant_turns_thinking() -> None:
    items = [
        {"type": "message", "role": "user", "content": "Weather?"},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "look"}],
        },
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "snow"},
    ]
    messages = input_messages(items)
    assert messages[1]["reasoning_content"] == "look" and messages[1]["tool_calls"][0]["id"] == "c1"
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "snow"}


ARGUMENTS = [
    {"city": "Paris", "unit": "celsius"},
    {"query": 'Rome "old" town\nline two', "note": "résumé 你好"},
    {"n": 3, "x": 1.5, "flag": True, "none": None, "nested": {"list": [1, "a", {"b": False}]}},
    {},
]


@pytest.mark.parametrize("chunk", [1, 5, 10_000])
def test_encoder_calls_parse_back(chunk: int) -> None:
    """What the encoder writes for a turn's calls parses back to the same calls, whole and streamed."""
    calls = [{"function": {"name": f"f{i}", "arguments": json.dumps(a)}} for i, a in enumerate(ARGUMENTS)]
    text = "Checking." + "\n\n" + dsml_tool_calls(calls)
    parser = V4.parser()
    content = ""
    for at in range(0, len(text), chunk):
        content += parser.feed(text[at : at + chunk])[0]
    content += parser.flush()[0]
    assert content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [
        (f"f{i}", a) for i, a in enumerate(ARGUMENTS)
    ]


MALFORMED = [
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a" str',  # truncated tag
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜invoke name="g">\n',  # nested invoke
    "\n\n<｜DSML｜tool_calls>\n<｜DSML｜tool_calls>\n<｜DSML｜invo",  # nested block, cut marker
    '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f"',  # no end of header
]


@pytest.mark.parametrize("tail", MALFORMED)
def test_malformed_dsml_is_returned_as_text(tail: str, caplog: pytest.LogCaptureFixture) -> None:
    text = "Answer." + tail
    with caplog.at_level(logging.WARNING, logger="dsinfer.gateway"):
        assert V4.parse(text) == (text, [])
    assert "malformed" in caplog.text
    parser = V4.parser()
    streamed = "".join(parser.feed(c)[0] for c in text) + parser.flush()[0]
    assert (streamed, parser.calls) == (text, [])


def test_dsml_fuzz_never_raises_and_keeps_the_text() -> None:
    """Random cuts, nested markers and bad JSON: no exception; a text that yields no call keeps
    every character of its section when the output ended by itself."""
    rng = random.Random(4)
    good = (
        "Hi" + "\n\n" + dsml_tool_calls([{"function": {"name": "f", "arguments": json.dumps(ARGUMENTS[2])}}])
    )
    markers = [
        V4.section_begin,
        V4.section_end,
        V4.call_begin,
        V4.args_end,
        '<｜DSML｜parameter name="',
        '">',
    ]
    for _ in range(2000):
        text = good
        for _ in range(rng.randint(1, 3)):
            at = rng.randint(0, len(text))
            kind = rng.randrange(3)
            if kind == 0:
                text = text[:at]
            elif kind == 1:
                marker = rng.choice(markers)
                text = text[:at] + marker[: rng.randint(1, len(marker))] + text[at:]
            else:
                text = text.replace("[1", rng.choice(["[", "{", '"'])).replace('"a"', "a", 1)
        content, calls = V4.parse(text)
        for call in calls:
            assert isinstance(json.loads(call.arguments), dict)
        if not calls and V4.section_end not in text:
            assert content == text, text


def test_forced_call_after_thinking_is_in_the_grammar(tiny_tokenizer: Tokenizer) -> None:
    """Thinking on, a call required: the grammar lets the thinking run to </think>, then the call."""
    grammar = llguidance.grammar_from(
        "lark",
        V4.grammar([ToolSpec("get_weather", WEATHER)], False, tiny_tokenizer.token_to_id, thinking=True),
    )
    call = '\n<｜DSML｜parameter name="city" string="true">Oslo</｜DSML｜parameter>\n<｜DSML｜parameter name="unit" string="true">celsius</｜DSML｜parameter>\n'
    output = (
        "a < b, so the tool"
        + END_THINK
        + "\n\n"
        + V4.section_begin
        + "\n"
        + V4.call_begin
        + '"get_weather">'
        + call
        + V4.args_end
        + "\n"
        + V4.section_end
    )
    cache = GrammarCache(tiny_tokenizer, tiny_tokenizer.vocab_size, tiny_tokenizer.eos_token_ids)
    matcher = cache.compiled(grammar).deep_copy()
    assert matcher.consume_tokens(tiny_tokenizer.encode(output, add_special_tokens=False)), (
        matcher.get_error()
    )
    assert matcher.is_accepting()
    reasoning, content = make_reasoning_parser("deepseek-v4", thinking=True).feed(output)
    assert reasoning == "a < b, so the tool"
    _, calls = V4.parse(content)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"})
    ]


def test_auto_tools_with_a_response_format_allow_a_call_or_the_answer(tiny_tokenizer: Tokenizer) -> None:
    """tool_choice auto and a JSON response_format: a call or an answer in the format, nothing else."""
    req = ChatCompletionRequest.model_validate(
        {
            "messages": ASK,
            "tools": TOOLS,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}},
        }
    )
    plan = plan_tools(req, "deepseek-v4", tiny_tokenizer.token_to_id)
    assert plan is not None and plan.with_response_format and plan.grammar is not None
    assert request_grammar(req, plan.grammar, True) == plan.grammar
    cache = GrammarCache(tiny_tokenizer, tiny_tokenizer.vocab_size, tiny_tokenizer.eos_token_ids)
    call = dsml_tool_calls(
        [{"function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]
    )
    for output, accepted in (
        ('{"answer":"sunny"}', True),
        ("\n\n" + call, True),
        ("Sunny.", False),
        ('{"answer":"hot"}', False),
    ):
        matcher = cache.compiled(plan.grammar).deep_copy()
        ok = (
            matcher.consume_tokens(tiny_tokenizer.encode(output, add_special_tokens=False))
            and matcher.is_accepting()
        )
        assert ok == accepted, output


# End to end ----------------------------------------------------------------------------------------
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    directory = tmp_path_factory.mktemp("v4_chat")
    build_v4("flash_like", directory, with_tokenizer=True)
    with serve(
        ["--model", str(directory), "--dtype", "float32"], tmp_path_factory.mktemp("v4_chat_log")
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.openai_client(timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _streamed_calls(stream: Any) -> tuple[list[tuple[str, str]], str, str, str | None]:
    calls: dict[int, list[str]] = {}
    reasoning, content, finish = "", "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for d in delta.tool_calls or []:
            entry = calls.setdefault(d.index, ["", ""])
            entry[0] += d.function.name or ""
            entry[1] += d.function.arguments or ""
    return [(n, a) for _, (n, a) in sorted(calls.items())], reasoning, content, finish


@pytest.mark.system
def test_chat_completions_two_round_tool_conversation(
    server: Server, client: openai.OpenAI, model: str
) -> None:
    kwargs: dict[str, Any] = dict(
        model=model, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=300, temperature=0
    )
    first = client.chat.completions.create(**kwargs).choices[0]
    assert first.finish_reason == "tool_calls"
    calls = first.message.tool_calls or []
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    arguments = json.loads(calls[0].function.arguments)
    assert set(arguments) >= {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    streamed, _, _, finish = _streamed_calls(client.chat.completions.create(stream=True, **kwargs))
    assert finish == "tool_calls"
    assert streamed == [(c.function.name, c.function.arguments) for c in calls]
    history: list[Any] = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [c.model_dump(include={"id", "type", "function"}) for c in calls],
        },
        {"role": "tool", "tool_call_id": calls[0].id, "content": "Sunny, 21 degrees"},
    ]
    tokens = httpx.post(
        f"{server.base_url}/tokenize", json={"messages": history, "tools": TOOLS}, timeout=30
    ).json()["tokens"]
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokens}, timeout=30).json()["prompt"]
    assert "<tool_result>Sunny, 21 degrees</tool_result>" in text
    assert '<｜DSML｜invoke name="get_weather">' in text and "## Tools" in text
    second = client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.system
def test_thinking_splits_reasoning_streamed_and_whole(client: openai.OpenAI, model: str) -> None:
    """Thinking on (reasoning_effort): the output up to </think> is reasoning_content; streamed
    and whole agree. Off: no reasoning."""
    kwargs: dict[str, Any] = dict(
        model=model, messages=ASK, max_tokens=12, temperature=0, reasoning_effort="high"
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message
    reasoning = getattr(whole, "reasoning_content", None) or ""
    assert reasoning
    _, streamed_reasoning, streamed_content, _ = _streamed_calls(
        client.chat.completions.create(stream=True, **kwargs)
    )
    assert (streamed_reasoning, streamed_content) == (reasoning, whole.content or "")
    plain = (
        client.chat.completions.create(model=model, messages=ASK, max_tokens=12, temperature=0)
        .choices[0]
        .message
    )
    assert not getattr(plain, "reasoning_content", None) and plain.content


@pytest.mark.system
def test_responses_two_round_function_calls(client: openai.OpenAI, model: str) -> None:
    tools: Any = [
        {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER}
    ]
    choice: Any = {"type": "function", "name": "get_weather"}
    kwargs: Any = dict(
        model=model,
        input="Weather in Paris?",
        tools=tools,
        tool_choice=choice,
        max_output_tokens=300,
        temperature=0,
    )
    first = client.responses.create(**kwargs)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments)["unit"] in ("celsius", "fahrenheit")
    with client.responses.stream(**kwargs) as stream:
        final = stream.get_final_response()
    assert [(i.name, i.arguments) for i in final.output if i.type == "function_call"] == [
        (calls[0].name, calls[0].arguments)
    ]
    second = client.responses.create(
        model=model,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny"}],
        tools=tools,
        max_output_tokens=8,
        temperature=0,
    )
    assert second.status in ("completed", "incomplete") and second.output


@pytest.mark.system
def test_anthropic_messages_two_round_tool_use(server: Server, model: str) -> None:
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", timeout=120, max_retries=0)
    tools: Any = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER}]
    ask: Any = [{"role": "user", "content": "Weather in Paris?"}]
    kwargs: Any = dict(
        model=model,
        max_tokens=300,
        messages=ask,
        tools=tools,
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0},
    )
    whole = claude.messages.create(**kwargs)
    assert whole.stop_reason == "tool_use"
    uses = [b for b in whole.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].input["unit"] in ("celsius", "fahrenheit")  # type: ignore[index]
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [
        (u.name, u.input) for u in uses
    ]
    history: Any = [
        *ask,
        {
            "role": "assistant",
            "content": [u.model_dump(include={"type", "id", "name", "input"}) for u in uses],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny"}]},
    ]
    second = claude.messages.create(
        model=model, max_tokens=8, messages=history, tools=tools, extra_body={"temperature": 0}
    )
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    thinking = claude.messages.create(
        model=model,
        max_tokens=12,
        messages=ask,
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={"temperature": 0},
    )
    assert thinking.content[0].type == "thinking" and thinking.content[0].thinking  # type: ignore[union-attr]
    with claude.messages.stream(
        model=model,
        max_tokens=12,
        messages=ask,
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={"temperature": 0},
    ) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in thinking.content]


@pytest.mark.system
def test_a_turn_calls_a_tool_or_answers_in_the_response_format(client: openai.OpenAI, model: str) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}}
    for seed in range(3):
        choice = client.chat.completions.create(
            model=model,
            messages=ASK,
            tools=TOOLS,
            response_format=fmt,
            parallel_tool_calls=False,
            max_tokens=300,
            seed=seed,
        ).choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            assert json.loads(choice.message.tool_calls[0].function.arguments)["unit"] in (
                "celsius",
                "fahrenheit",
            )
        else:
            assert choice.finish_reason == "stop"
            assert json.loads(choice.message.content or "")["answer"] in ("sunny", "rainy")
