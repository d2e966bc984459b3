"""One source of truth for configuration (issue 38): every engine, gateway and pool flag of
``dsinfer generate``, ``eval`` and ``serve`` defaults to its field of EngineArgs, GatewayArgs or
PoolArgs, so that a default is never written twice. Parsers only: nothing starts."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator

import pytest
from pydantic import BaseModel

from dsinfer.cli.engine_args import add_engine_args, engine_args_from, field_default, size_text
from dsinfer.cli.flags import actions_of
from dsinfer.cli.gateway_args import API_KEY_ENV, add_gateway_args, gateway_args_from
from dsinfer.cli.main import build_parser
from dsinfer.cli.pool_args import add_pool_args, pool_args_from
from dsinfer.cli.serve import serve_parser
from dsinfer.engine.args import EngineArgs, parse_size
from dsinfer.gateway.args import GatewayArgs
from dsinfer.workers.args import PoolArgs

Field = tuple[type[BaseModel], str]

# Each add_*_args function and the model its flags fill.
GROUPS: list[tuple[Callable[[argparse.ArgumentParser], None], type[BaseModel]]] = [
    (add_engine_args, EngineArgs),
    (add_gateway_args, GatewayArgs),
    (add_pool_args, PoolArgs),
]
# Flags whose field has another name, or lives in another group's model.
FIELD_OF: dict[str, Field] = {
    "worker_host": (PoolArgs, "host"),  # --host is the gateway's
    "drain_timeout": (GatewayArgs, "drain_timeout"),  # a pool's flag that drains the gateway too
}
# Flags that do not take their field's default, and why.
EXCEPTIONS = {
    "gateway_addr": "PoolArgs requires it: None is 'not given', which a pool role refuses",
}
# Arguments each command requires, to parse it with every other flag at its default.
COMMANDS = {"generate": ["--prompt", "p"], "eval": [], "serve": []}


@pytest.fixture(autouse=True)
def _no_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """--api-key's default is read from the environment when a parser is built."""
    monkeypatch.delenv(API_KEY_ENV, raising=False)


def field_of(dest: str, model: type[BaseModel]) -> Field | None:
    if dest in FIELD_OF:
        return FIELD_OF[dest]
    return (model, dest) if dest in model.model_fields else None


def model_flags() -> Iterator[tuple[str, Field | None]]:
    """(dest, field) of every flag the add_*_args functions define."""
    for add, model in GROUPS:
        for action in actions_of(add):
            yield action.dest, field_of(action.dest, model)


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: sub.choices[name] for name in COMMANDS}


def test_every_model_flag_maps_to_a_field() -> None:
    unmapped = [dest for dest, field in model_flags() if field is None]
    assert unmapped == []


@pytest.mark.parametrize("command", COMMANDS)
def test_flags_default_to_their_fields(command: str) -> None:
    parsed = vars(subparsers()[command].parse_args(COMMANDS[command]))
    fields = {
        dest: field
        for dest, field in model_flags()
        if field is not None and dest in parsed and dest not in EXCEPTIONS
    }
    assert fields, f"{command} has no engine, gateway or pool flags"
    wrong = {
        dest: (parsed[dest], f"{model.__name__}.{name}", field_default(model, name))
        for dest, (model, name) in fields.items()
        if parsed[dest] != field_default(model, name)
    }
    assert wrong == {}, "flag: (its default, field, field's default)"
    mistyped = [
        dest
        for dest, (model, name) in fields.items()
        if type(parsed[dest]) is not type(field_default(model, name))
    ]
    assert mistyped == []


def test_default_flags_build_default_models() -> None:
    args = serve_parser().parse_args([])
    addr = "127.0.0.1:5000"
    assert engine_args_from(args) == EngineArgs()
    assert gateway_args_from(args) == GatewayArgs()
    assert pool_args_from(args, "decode", engine_args_from(args), gateway_addr=addr) == PoolArgs(
        role="decode", gateway_addr=addr
    )


def test_api_key_default_is_the_environments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "sk-test")
    assert serve_parser().parse_args([]).api_key == "sk-test"


def test_help_shows_field_descriptions() -> None:
    helps = {action.dest: action.help or "" for add, _ in GROUPS for action in actions_of(add)}
    missing = {
        dest: description
        for dest, field in model_flags()
        if field is not None
        and (description := field[0].model_fields[field[1]].description) is not None
        and description not in helps[dest]
    }
    assert missing == {}
    for parser in (*subparsers().values(), serve_parser()):
        parser.format_help()  # a stray % in a help text fails here, not at --help


@pytest.mark.parametrize(
    ("size", "text"),
    [(1000, "1000"), (2**10, "1KiB"), (3 * 2**20, "3MiB"), (8 * 2**30, "8GiB"), (2**40 + 2**30, "1025GiB")],
)
def test_size_text_reads_back(size: int, text: str) -> None:
    assert size_text(size) == text
    assert parse_size(text) == size


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--speculative-mtp", "--speculative-num-steps", "3", "--speculative-steps-by-batch", "16:2,64:1",
         "--speculative-draft-dtype", "bfloat16", "--kv-cache-memory", "4GiB", "--no-prefix-caching"],
    ],
)  # fmt: skip
def test_child_command_lines_read_back(argv: list[str]) -> None:
    """The all-in-one server hands its engine flags to its pools as ``flags_of`` writes them: they
    parse back to the same EngineArgs, the defaults included."""
    from dsinfer.cli.serve_all_in_one import flags_of

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(argv)
    again = parser.parse_args(flags_of(args, parser._actions))
    assert engine_args_from(again) == engine_args_from(args)
