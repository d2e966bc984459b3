"""The application-facing APIs end to end, through ``dsinfer serve`` as real processes (the
all-in-one PD server and ``--colocated``) driven by the official ``openai`` and ``anthropic``
clients on the tiny checkpoint's random weights.

Covered: tool calling (auto, required, a named function; streamed tool-call deltas; a tool-role
round trip), structured output (json_object, json_schema with nested objects, arrays and enums,
vLLM's regex and choice extras) where every constrained output must parse and validate under its
schema (jsonschema), echo + logprobs against transformers' teacher-forced logprobs, /v1/responses
and Anthropic's /v1/messages (text, streaming events, tools)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
import torch

from harness.checkpoints import BuiltCheckpoint
from harness.hf_reference import LOGIT_RTOL, hf_logits
from harness.server import Server, serve

pytestmark = pytest.mark.system

ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-num-batched-tokens", "40"]
API_KEY = "test-key"

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": -100, "maximum": 100},
        "b": {"type": "integer", "minimum": -100, "maximum": 100},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
PERSON = {  # nested objects, arrays, enums; every value bounded so random weights finish it
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "kind": {"enum": ["home", "work"]},
                "verified": {"type": "boolean"},
            },
            "required": ["kind", "verified"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}  # the anthropic client no longer takes temperature as an argument


@pytest.fixture(scope="module", params=["pd", "colocated"])
def server(
    request: pytest.FixtureRequest, tiny_ckpt: BuiltCheckpoint, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    mode = ["--colocated"] if request.param == "colocated" else []
    args = ["--model", str(tiny_ckpt.path), *ENGINE_FLAGS, *mode, "--api-key", API_KEY]
    with serve(args, tmp_path_factory.mktemp(f"api-{request.param}")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    name = client.models.list().data[0].id
    assert client.models.retrieve(name).id == name
    return name


def _check_calls(calls: list[Any], allowed: set[str]) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _forced(client: openai.OpenAI, model: str, tool: str) -> Any:
    """A greedy chat completion of ``ASK`` that must call ``tool``."""
    choice = {"type": "function", "function": {"name": tool}}
    return client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=80, temperature=0
    )


def test_tool_choice_required_and_named(client: openai.OpenAI, model: str) -> None:
    for seed in range(2):
        r = client.chat.completions.create(
            model=model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80, seed=seed
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        _check_calls(choice.message.tool_calls or [], set(SCHEMAS))
    r = _forced(client, model, "add")
    calls = r.choices[0].message.tool_calls or []
    assert len(calls) == 1 and r.choices[0].finish_reason == "tool_calls"
    _check_calls(calls, {"add"})
    r = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
    )
    assert len(r.choices[0].message.tool_calls or []) == 1


def test_tool_choice_auto_and_none(client: openai.OpenAI, model: str) -> None:
    """Random weights rarely call a tool unconstrained: auto answers (content, or parsed calls)."""
    for choice in ("auto", "none"):
        r = client.chat.completions.create(
            model=model, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=16, temperature=0
        )
        c = r.choices[0]
        assert c.finish_reason in ("stop", "length", "tool_calls")
        if c.message.tool_calls:
            assert choice == "auto"
            _check_calls(c.message.tool_calls, set(SCHEMAS))
        else:
            assert c.message.content


def test_streamed_tool_deltas_equal_whole(client: openai.OpenAI, model: str) -> None:
    kwargs: dict[str, Any] = dict(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls or []
    calls: dict[int, dict[str, Any]] = {}
    pieces, finish = 0, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for d in chunk.choices[0].delta.tool_calls or []:
            if d.index not in calls:
                assert d.id and d.function and d.function.name, "a call's first delta names it"
                calls[d.index] = {"name": d.function.name, "arguments": d.function.arguments or ""}
                continue
            assert d.id is None
            calls[d.index]["arguments"] += d.function.arguments or ""
            pieces += 1
    assert finish == "tool_calls"
    assert pieces > 1, "the arguments arrive as they are generated"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole
    ]


def test_tool_role_round_trip(server: Server, client: openai.OpenAI, model: str) -> None:
    first = _forced(client, model, "get_weather")
    call = (first.choices[0].message.tool_calls or [])[0]
    history: list[Any] = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees"},
    ]
    rendered = httpx.post(
        f"{server.base_url}/tokenize",
        json={"messages": history, "tools": TOOLS, "return_token_strs": True},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    ).json()
    text = "".join(rendered["token_strs"])
    assert "<｜tool▁output▁begin｜>Sunny, 21 degrees<｜tool▁output▁end｜>" in text
    assert call.function.arguments in text
    second = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=8)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_json_object(server: Server, client: openai.OpenAI, model: str) -> None:
    """Biased toward '"' and '}', unconstrained output is not JSON; constrained it is an object."""
    ids = httpx.post(
        f"{server.base_url}/tokenize",
        json={"prompt": '"}', "add_special_tokens": False},
        headers={"x-api-key": API_KEY},
        timeout=30,
    ).json()["tokens"]
    bias = {str(t): 8 for t in ids}
    kwargs: dict[str, Any] = dict(model=model, messages=ASK, max_tokens=40, temperature=0, logit_bias=bias)
    free = client.chat.completions.create(**kwargs).choices[0].message.content or ""
    with pytest.raises(json.JSONDecodeError):
        json.loads(free)
    r = client.chat.completions.create(response_format={"type": "json_object"}, **kwargs)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content or ""), dict)


def test_json_schema(client: openai.OpenAI, model: str) -> None:
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}}
    r = client.chat.completions.create(
        model=model, messages=ASK, response_format=fmt, max_tokens=120, temperature=1, seed=3, n=3
    )
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content or ""), PERSON)
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(
            model=model, messages=ASK, response_format=fmt, max_tokens=120, temperature=0, stream=True
        )
        if chunk.choices
    )
    jsonschema.validate(json.loads(streamed), PERSON)
    done = client.completions.create(
        model=model, prompt="A person:", max_tokens=120, temperature=0, extra_body={"guided_json": PERSON}
    )
    jsonschema.validate(json.loads(done.choices[0].text), PERSON)


def test_regex_and_choice(client: openai.OpenAI, model: str) -> None:
    pattern = r"[a-z]{3}-[0-9]{2}"
    options = ["red", "green", "blue"]
    for seed in range(2):
        r = client.completions.create(
            model=model,
            prompt="A code:",
            max_tokens=20,
            seed=seed,
            extra_body={"structured_outputs": {"regex": pattern}},
        )
        assert re.fullmatch(pattern, r.choices[0].text) and r.choices[0].finish_reason == "stop"
        chat = client.chat.completions.create(
            model=model, messages=ASK, max_tokens=20, seed=seed, extra_body={"guided_choice": options}
        )
        assert chat.choices[0].message.content in options
    with pytest.raises(openai.BadRequestError, match="structured_outputs"):
        client.completions.create(model=model, prompt="x", extra_body={"structured_outputs": {"regex": "(a"}})


def test_echo_logprobs_equal_transformers(
    client: openai.OpenAI, model: str, tiny_ckpt: BuiltCheckpoint
) -> None:
    """lm-eval's loglikelihood request: echo + logprobs with max_tokens 0 (and 1)."""
    prompt = "The capital of France is Paris"
    for max_tokens in (0, 1):
        r = client.completions.create(
            model=model,
            prompt=prompt,
            echo=True,
            logprobs=2,
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"return_tokens_as_token_ids": True},
        )
        lp = r.choices[0].logprobs
        assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
        assert r.choices[0].text.startswith(prompt)
        ids = [int(t.removeprefix("token_id:")) for t in lp.tokens]
        n_prompt = len(ids) - max_tokens
        assert lp.token_logprobs[0] is None and len(ids) == r.usage.prompt_tokens + max_tokens  # type: ignore[union-attr]
        logits = hf_logits(tiny_ckpt.hf_model, ids[:n_prompt])
        reference = torch.log_softmax(logits.double(), dim=-1)
        for pos in range(1, n_prompt):
            scale = float(logits[pos - 1].abs().max())
            tolerance = 2 * LOGIT_RTOL * scale  # a logprob moves with the logit and the normalizer
            assert abs(lp.token_logprobs[pos] - float(reference[pos - 1, ids[pos]])) <= tolerance
            top = lp.top_logprobs[pos]  # type: ignore[index]
            assert top is not None
            for token, value in top.items():
                assert (
                    abs(value - float(reference[pos - 1, int(token.removeprefix("token_id:"))])) <= tolerance
                )


def test_responses(server: Server, client: openai.OpenAI, model: str) -> None:
    first = client.responses.create(
        model=model, input="Hello", instructions="Be brief.", max_output_tokens=6, temperature=0
    )
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"  # type: ignore[union-attr]
    assert first.output_text and first.usage is not None and first.usage.output_tokens == 6
    assert client.responses.retrieve(first.id).output_text == first.output_text
    follow = client.responses.create(
        model=model, input="And then?", previous_response_id=first.id, max_output_tokens=4, temperature=0
    )
    assert follow.usage is not None and follow.usage.input_tokens > first.usage.input_tokens + 4
    with pytest.raises(openai.NotFoundError, match="resp_unknown"):
        client.responses.create(model=model, input="x", previous_response_id="resp_unknown")
    tools: Any = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    kwargs: Any = dict(
        model=model,
        input="Weather in Paris?",
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=80,
        temperature=0,
    )
    whole = client.responses.create(**kwargs)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert len(calls) == 1 and whole.status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    with client.responses.stream(**kwargs) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_response()
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types.count("response.function_call_arguments.delta") > 1 and types[-1] == "response.completed"
    streamed = [item for item in final.output if item.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    round_trip = client.responses.create(
        model=model,
        input=[
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny"},
        ],
        previous_response_id=whole.id,
        max_output_tokens=4,
    )
    assert round_trip.status in ("completed", "incomplete")
    schema = client.responses.create(
        model=model,
        input="A person",
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
        max_output_tokens=120,
        temperature=0,
    )
    jsonschema.validate(json.loads(schema.output_text), PERSON)


@pytest.fixture(scope="module")
def claude(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, timeout=120, max_retries=0)


def test_messages_text_and_stream(claude: anthropic.Anthropic, model: str) -> None:
    kwargs: Any = dict(
        model=model,
        max_tokens=8,
        system="Be brief.",
        messages=[{"role": "user", "content": "Hi"}],
        extra_body=GREEDY,
    )
    whole = claude.messages.create(**kwargs)
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 8
    assert whole.content[0].type == "text" and whole.content[0].text
    with claude.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == "max_tokens"
    stop = whole.content[0].text[2:5]  # type: ignore[union-attr]
    cut = claude.messages.create(**{**kwargs, "stop_sequences": [stop]})
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    bad = anthropic.Anthropic(base_url=claude.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        bad.messages.create(**kwargs)
    assert info.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    with pytest.raises(anthropic.BadRequestError, match="image"):
        claude.messages.create(**{**kwargs, "messages": [{"role": "user", "content": [image]}]})


def test_messages_tools(claude: anthropic.Anthropic, model: str) -> None:
    tools: Any = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER}]
    ask: Any = [{"role": "user", "content": "Weather in Paris?"}]
    named: Any = {"type": "tool", "name": "get_weather"}
    whole = claude.messages.create(
        model=model, max_tokens=80, messages=ask, tools=tools, tool_choice=named, extra_body=GREEDY
    )
    assert whole.stop_reason == "tool_use"
    uses = [b for b in whole.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER)
    with claude.messages.stream(
        model=model, max_tokens=80, messages=ask, tools=tools, tool_choice=named, extra_body=GREEDY
    ) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert events.count("input_json") > 1, "tool input streams as input_json_delta"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [
        (u.name, u.input) for u in uses
    ]
    required = claude.messages.create(
        model=model,
        max_tokens=80,
        messages=ask,
        tools=tools,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )
    assert required.stop_reason == "tool_use"
    history: Any = [
        *ask,
        {
            "role": "assistant",
            "content": [u.model_dump(include={"type", "id", "name", "input"}) for u in uses],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny"}]},
    ]
    answer = claude.messages.create(model=model, max_tokens=4, messages=history, tools=tools)
    assert answer.stop_reason in ("max_tokens", "end_turn", "tool_use")
