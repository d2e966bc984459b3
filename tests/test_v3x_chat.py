"""DeepSeek-V3.1 and V3.2 chat: the presets' chat templates (thinking on and off, history, tools,
tool calls and tool results) rendered with the tiny tokenizer, and the thinking-aware reasoning
parsers, alone and through the gateway's chat endpoint with ``chat_template_kwargs``.

Tool calling itself (parsing the model's tool calls into OpenAI ``tool_calls``) is the tool-call
parsers' (tests/test_tool_parsers.py, tests/test_api_clients.py); the templates' tool rendering is
checked here directly."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from dsinfer.base.presets import RANDOM_MODEL, presets_dir, resolve_model
from dsinfer.base.tokenizer import Tokenizer
from dsinfer.gateway.app import build_app
from dsinfer.gateway.args import GatewayArgs
from dsinfer.gateway.backend import Capacity
from dsinfer.gateway.reasoning import make_reasoning_parser
from tests.fixtures.engine_backend import ScriptedBackend, serve, text_deltas

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
MODELS = ("deepseek-v3.1", "deepseek-v3.2")
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "<think>greeting</think>Hi!"},
    {"role": "user", "content": "1+1=?"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def _tokenizer(model: str, tmp: Path) -> Tokenizer:
    """The tiny tokenizer with ``model``'s chat template."""
    tiny = resolve_model(RANDOM_MODEL)[0]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, tmp / name)
    shutil.copy(presets_dir() / model / "chat_template.jinja", tmp / "chat_template.jinja")
    return Tokenizer.from_dir(tmp)


@pytest.fixture(params=MODELS)
def tokenizer(request: pytest.FixtureRequest, tmp_path: Path) -> Tokenizer:
    return _tokenizer(request.param, tmp_path)


def test_thinking_off_and_on(tokenizer: Tokenizer) -> None:
    history = f"{BOS}Be brief.{USER}hello{ASSISTANT}</think>Hi!{EOS}{USER}1+1=?{ASSISTANT}"
    assert tokenizer.apply_chat_template(CHAT) == history + "</think>"  # off by default
    assert tokenizer.apply_chat_template(CHAT, thinking=False) == history + "</think>"
    assert tokenizer.apply_chat_template(CHAT, thinking=True) == history + "<think>"
    assert tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=False, thinking=True
    ) == history.removesuffix(ASSISTANT)


def test_tools_tool_calls_and_results(tokenizer: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "You help."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
            ],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "rain"},
        {"role": "assistant", "content": "Paris is sunny, Rome rainy."},
        {"role": "user", "content": "Thanks"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, thinking=True)
    system, _, turns = text.partition(USER)
    assert system.startswith(
        f"{BOS}You help.\n\n## Tools\nYou have access to the following tools:\n\n### get_weather\n"
    )
    assert 'Parameters: {"type": "object", "properties": {"city": {"type": "string"}}}' in system
    assert (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>tool_call_name<｜tool▁sep｜>tool_call_arguments" in system
    )
    calls = (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>'
        '{"city": "Rome"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    assert turns == (
        f"Weather in Paris and Rome?{ASSISTANT}</think>{calls}{EOS}"
        "<｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜><｜tool▁output▁begin｜>rain<｜tool▁output▁end｜>"
        f"Paris is sunny, Rome rainy.{EOS}{USER}Thanks{ASSISTANT}<think>"
    )
    # after a tool result the model goes on by itself: no new assistant turn is opened
    assert tokenizer.apply_chat_template(messages[:4], tools=TOOLS).endswith("<｜tool▁output▁end｜>")


def test_unknown_role_is_refused(tokenizer: Tokenizer) -> None:
    from dsinfer.base.tokenizer import TokenizerError

    with pytest.raises(TokenizerError, match="Unsupported chat role: critic"):
        tokenizer.apply_chat_template([{"role": "critic", "content": "x"}])


@pytest.mark.parametrize("name", ["deepseek-v3.1", "deepseek-v3.2"])
def test_reasoning_parser_follows_the_thinking_mode(name: str) -> None:
    thinking = make_reasoning_parser(name, thinking=True)
    assert thinking is not None
    parts = [thinking.feed(t) for t in ("Let me", " think.</th", "ink>The answer", " is 2.")]
    parts.append(thinking.flush())
    assert (
        "".join(p[0] for p in parts) == "Let me think." and "".join(p[1] for p in parts) == "The answer is 2."
    )
    plain = make_reasoning_parser(name, thinking=False)
    assert plain is not None
    assert [plain.feed("No </think> here"), plain.flush()] == [("", "No </think> here"), ("", "")]
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        make_reasoning_parser("deepseek-v9")


@pytest.fixture(scope="module")
def chat_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ScriptedBackend]]:
    """A gateway with the V3.1 template and its reasoning parser over a backend that always answers
    "Let me think.</think>It is 2."; the backend records what it was sent."""
    tokenizer = _tokenizer("deepseek-v3.1", tmp_path_factory.mktemp("v31"))
    reply = tokenizer.encode("Let me think.</think>It is 2.", add_special_tokens=False)
    backend = ScriptedBackend(
        lambda job: text_deltas([reply[:3], reply[3:]], n=job.params.n),
        capacity=Capacity(4096, 64, {"colocated": 1000}),  # what a registered pool would hold
    )
    app = build_app(
        backend, tokenizer, GatewayArgs(model=RANDOM_MODEL, reasoning_parser="deepseek-v3.1"), 4096
    )
    with serve(app) as url:
        yield url, backend


def test_chat_endpoint_thinking_kwarg(chat_url: tuple[str, ScriptedBackend]) -> None:
    url, backend = chat_url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "1+1=?"}]
    thinking = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, extra_body={"chat_template_kwargs": {"thinking": True}}
    )
    message = thinking.choices[0].message
    assert getattr(message, "reasoning_content", None) == "Let me think." and message.content == "It is 2."
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
    message = plain.choices[0].message
    assert getattr(message, "reasoning_content", None) is None
    assert message.content == "Let me think.</think>It is 2."  # not thinking: all of it is the answer
    tokenizer = Tokenizer.from_dir(resolve_model(RANDOM_MODEL)[0])
    prompts = [tokenizer.decode(job.prompt_token_ids, skip_special_tokens=False) for job in backend.submitted]
    assert prompts[0].endswith(f"{USER}1+1=?{ASSISTANT}<think>")
    assert prompts[1].endswith(f"{USER}1+1=?{ASSISTANT}</think>")
