"""`dsinfer generate` and `dsinfer serve` explain every flag (issue 45): each has help, and each
that takes a value with a default shows it; `generate` says on stderr when its output stopped at
--max-tokens. Parsers and a stand-in LLM only: nothing loads a model."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

import pytest

import dsinfer.cli.generate as generate
from dsinfer.cli.gateway_args import API_KEY_ENV
from dsinfer.cli.main import build_parser, main
from dsinfer.cli.serve import serve_parser
from dsinfer.engine.outputs import CompletionOutput


@pytest.fixture(autouse=True)
def _no_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """--api-key's default is read from the environment when a parser is built."""
    monkeypatch.delenv(API_KEY_ENV, raising=False)


def parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {
        "generate": sub.choices["generate"],
        "serve": sub.choices["serve"],
        "serve_parser": serve_parser(),
    }


def _flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("command", ["generate", "serve", "serve_parser"])
def test_every_flag_has_help(command: str) -> None:
    parser = parsers()[command]
    assert [a.option_strings for a in _flags(parser) if not (a.help or "").strip()] == []
    parser.format_help()  # a stray % in a help text fails here, not at --help


@pytest.mark.parametrize("command", ["generate", "serve", "serve_parser"])
def test_every_default_is_shown(command: str) -> None:
    """A flag that takes a value and has a default says what it is (None: "not given", which the
    help explains in words; on/off flags say what happens without them)."""
    hidden = [
        a.option_strings
        for a in _flags(parsers()[command])
        if a.nargs != 0 and a.default is not None and "default" not in (a.help or "").lower()
    ]
    assert hidden == []


def test_generate_help_shows_max_tokens_default() -> None:
    text = " ".join(parsers()["generate"].format_help().split())
    assert "--max-tokens MAX_TOKENS most tokens to generate (default: 32)" in text


@dataclass
class _Request:
    outputs: list[CompletionOutput]


@dataclass
class _FakeLLM:
    finish_reason: str
    engine: Any = field(default=None)

    def __post_init__(self) -> None:
        self.engine = self
        self.closed = False

    def generate(self, prompts: list[str], params: Any, use_tqdm: bool) -> list[_Request]:
        ids = list(range(params.max_tokens))
        return [_Request([CompletionOutput(0, "a b c", ids, self.finish_reason, None)])]

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize(("finish_reason", "noticed"), [("length", True), ("stop", False)])
def test_generate_says_when_max_tokens_cut_the_output(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], finish_reason: str, noticed: bool
) -> None:
    llm = _FakeLLM(finish_reason)
    monkeypatch.setattr(generate.LLM, "from_engine_args", lambda engine_args: llm)
    assert main(["generate", "--prompt", "x", "--max-tokens", "3"]) == 0
    out, err = capsys.readouterr()
    assert out == "a b c\n" and llm.closed
    notice = "dsinfer: the output stopped at --max-tokens 3 (finish_reason length)"
    assert (notice in err) is noticed, err
    assert len(err.strip().splitlines()) == (1 if noticed else 0), err
