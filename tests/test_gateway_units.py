"""Gateway pieces without a server: the R1 reasoning parser, stop-string hold-back and cut,
detokenization of characters split across tokens, GatewayArgs and its command-line flags."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from pydantic import ValidationError

from dsinfer.base.presets import resolve_model
from dsinfer.base.protocol import TokenDelta
from dsinfer.base.tokenizer import Tokenizer
from dsinfer.cli.engine_args import add_engine_args
from dsinfer.cli.gateway_args import add_gateway_args, gateway_args_from
from dsinfer.gateway.args import GatewayArgs
from dsinfer.gateway.choice import ChoiceState, held_back
from dsinfer.gateway.reasoning import DeepSeekR1ReasoningParser

NI = [166, 127, 260]  # the three byte-level tokens of "你" (E4 BD A0) in the tiny tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model("tiny")[0])


def _parse(pieces: list[str], forced: bool = True) -> tuple[str, str, list[tuple[str, str]]]:
    parser = DeepSeekR1ReasoningParser(forced)
    out = [parser.feed(p) for p in pieces] + [parser.flush()]
    return "".join(r for r, _ in out), "".join(c for _, c in out), out


@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        ("thinking hard</think>\n\nThe answer", "thinking hard", "\n\nThe answer"),
        ("<think>\nthinking</think>answer", "\nthinking", "answer"),
        ("</think>answer", "", "answer"),
        ("still thinking when cut off", "still thinking when cut off", ""),
        ("a </think> b </think> c", "a ", " b </think> c"),
        ("<thin", "<thin", ""),
        ("", "", ""),
    ],
)
def test_r1_parser_every_split(text: str, reasoning: str, content: str) -> None:
    """Whatever way the text is cut into deltas, the split is the same and no tag leaks."""
    assert _parse([text])[:2] == (reasoning, content)
    for cut in range(len(text) + 1):
        assert _parse([text[:cut], text[cut:]])[:2] == (reasoning, content), cut
    assert _parse(list(text))[:2] == (reasoning, content)


@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        ("<think>7 * 8 = 56</think>56", "7 * 8 = 56", "56"),
        ("42", "", "42"),
        ("<thin", "", "<thin"),
        ("4</think>2", "", "4</think>2"),
        ("<think>cut off", "cut off", ""),
        ("", "", ""),
    ],
)
def test_think_optional_parser_every_split(text: str, reasoning: str, content: str) -> None:
    """think-optional (the built-in model's): only a reply that opens with <think> thinks."""
    for cut in range(len(text) + 1):
        assert _parse([text[:cut], text[cut:]], forced=False)[:2] == (reasoning, content), cut
    assert _parse(list(text), forced=False)[:2] == (reasoning, content)


def test_r1_parser_streams_as_it_goes() -> None:
    _, _, out = _parse(["Let me ", "think</", "think>The ", "answer"])
    assert out[0] == ("Let me ", "")
    assert out[1] == ("think", "")  # "</" held back: it may be the tag
    assert out[2] == ("", "The ")
    assert out[3] == ("", "answer")


def test_held_back() -> None:
    assert held_back("Hello wor", ["world"]) == 3
    assert held_back("Hello w", ["world", "xyz"]) == 1
    assert held_back("Hello", ["world"]) == 0
    assert held_back("abcab", ["abcabd", "b"]) == 5
    assert held_back("", ["x"]) == 0


def _choice(
    tokenizer: Tokenizer, stops: list[str], include: bool = False, reasoning: bool = False
) -> ChoiceState:
    return ChoiceState(
        tokenizer,
        stops=stops,
        skip_special_tokens=True,
        include_stop_str=include,
        reasoning=DeepSeekR1ReasoningParser() if reasoning else None,
    )


def test_split_utf8_character_is_never_sent_in_halves(tokenizer: Tokenizer) -> None:
    assert tokenizer.decode(NI) == "你"
    assert all(tokenizer.decode([t]) == "\ufffd" for t in NI)
    state = _choice(tokenizer, [])
    hello = tokenizer.encode("Hi ", add_special_tokens=False)
    texts = [state.update(TokenDelta(request_id="r", token_ids=[t])).text for t in [*hello, *NI]]
    texts.append(state.update(TokenDelta(request_id="r", finish_reason="length")).text)
    assert "".join(texts) == "Hi 你"
    assert texts[-4:] == ["", "", "你", ""]
    assert all("\ufffd" not in t for t in texts)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_held_back_then_cut(tokenizer: Tokenizer, include: bool) -> None:
    pieces = ["Hello", " wor", "ld and more"]
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in pieces]
    state = _choice(tokenizer, ["world"], include=include)
    sent = [state.update(TokenDelta(request_id="r", token_ids=ids[0])).text]
    sent.append(state.update(TokenDelta(request_id="r", token_ids=ids[1])).text)
    assert sent == ["Hello", " "]  # "wor" could start "world": held back
    last = state.update(TokenDelta(request_id="r", token_ids=ids[2]))  # the gateway finds "world"
    expected = "Hello world" if include else "Hello "
    assert "".join([*sent, last.text]) == state.text == expected
    assert last.finish_reason == "stop" and state.stopped_by_string
    # the token that completed the stop string is the last one: " and more" is dropped
    assert tokenizer.decode(state.token_ids).startswith("Hello world")
    assert "more" not in tokenizer.decode(state.token_ids)


def test_held_back_text_released_when_no_stop_matches(tokenizer: Tokenizer) -> None:
    state = _choice(tokenizer, ["world"])
    assert (
        state.update(
            TokenDelta(request_id="r", token_ids=tokenizer.encode("Hi wor", add_special_tokens=False))
        ).text
        == "Hi "
    )
    end = state.update(TokenDelta(request_id="r", finish_reason="length"))
    assert end.text == "wor"


def test_reasoning_after_stop_cut(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("plan</think>answer. END tail", add_special_tokens=False)
    state = _choice(tokenizer, ["END"], reasoning=True)
    update = state.update(TokenDelta(request_id="r", token_ids=ids))
    assert (state.reasoning, state.text) == ("plan", "answer. ")
    assert update.finish_reason == "stop" and "tail" not in tokenizer.decode(state.token_ids)


def test_error_delta_ends_the_choice(tokenizer: Tokenizer) -> None:
    state = _choice(tokenizer, [])
    update = state.update(TokenDelta(request_id="r", error="worker died"))
    assert update.error == "worker died" and state.finished


def test_gateway_args_validation(tmp_path: Path) -> None:
    assert GatewayArgs().model_name() == "tiny-chat"
    assert GatewayArgs(served_model_name="ds").model_name() == "ds"
    for bad in (
        {"reasoning_parser": "qwen"},
        {"balancer": "random"},
        {"max_queued_requests": 0},
        {"request_timeout": 0},
        {"max_n": 0},
        {"port": 70000},
        {"chat_template": tmp_path / "missing.jinja"},
        {"unknown": 1},
    ):
        with pytest.raises(ValidationError):
            GatewayArgs(**bad)
    with pytest.raises(ValidationError):
        GatewayArgs().host = "0.0.0.0"  # type: ignore[misc]


def test_gateway_flags(tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    add_gateway_args(parser)
    ns = parser.parse_args(
        [
            *("--host", "0.0.0.0", "--port", "9000", "--control-port", "9001", "--served-model-name", "r1"),
            *("--chat-template", str(template), "--api-key", "k", "--reasoning-parser", "deepseek-r1"),
            *("--max-queued-requests", "8", "--request-timeout", "2.5", "--max-n", "4", "--balancer", "round_robin"),
            *("--max-model-len", "512",),
        ]
    )  # fmt: skip
    args = gateway_args_from(ns)
    assert args == GatewayArgs(
        host="0.0.0.0",
        port=9000,
        control_port=9001,
        served_model_name="r1",
        chat_template=template,
        api_key="k",
        reasoning_parser="deepseek-r1",
        max_queued_requests=8,
        request_timeout=2.5,
        max_n=4,
        balancer="round_robin",
    )
    defaults = gateway_args_from(parser.parse_args([]))
    assert defaults.port == 8000 and defaults.max_n == 16 and defaults.reasoning_parser == "auto"
    assert gateway_args_from(parser.parse_args(["--reasoning-parser", "none"])).reasoning_parser is None
    with pytest.raises(ValidationError):
        gateway_args_from(parser.parse_args(["--max-n", "0"]))
