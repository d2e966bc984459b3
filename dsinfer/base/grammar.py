"""Grammars for constrained decoding, in llguidance's form (a maintained grammar engine, CPU wheels).

A request's constraint travels as one string, ``SamplingParams.grammar``: an llguidance grammar
built here from what the APIs accept (a JSON schema, "any JSON object", a regex, a list of
choices, a Lark or GBNF grammar; the gateway's tool-call grammars are Lark with ``%json``
schemas inside). ``check`` compiles it without a tokenizer and returns llguidance's message for
a bad one, so the gateway answers 400 naming the problem and no worker ever sees it. The worker
builds the token-level matcher from the same string (dsinfer/engine/grammar.py) and caches it.

JSON is compact (no free whitespace between tokens): a model, random weights included, can
never stall in a run of blanks, and every output is still valid JSON.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

__all__ = ["JSON_OPTIONS", "check", "choice", "from_lark", "json_object", "json_schema", "lark", "regex"]

JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}  # separators "," and ":" only


class GrammarError(ValueError):
    """A grammar, schema or pattern the grammar engine refuses; the message says why."""


def json_schema(schema: dict[str, Any] | bool | str) -> str:
    """The grammar of JSON documents valid under ``schema`` (draft 2020-12, as llguidance reads it)."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=dict(JSON_OPTIONS))  # type: ignore[arg-type]
    except ValueError as e:
        raise GrammarError(f"the JSON schema is not a JSON object: {e}") from None


def json_object() -> str:
    """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
    return json_schema({"type": "object"})


def regex(pattern: str) -> str:
    return llguidance.LLMatcher.grammar_from_regex(pattern)


def choice(options: list[str]) -> str:
    """Exactly one of ``options``."""
    return llguidance.grammar_from("choice", json.dumps(options))


def from_lark(text: str) -> str:
    """A Lark grammar (llguidance's dialect) or a GBNF one (llama.cpp's), told apart by llguidance."""
    return llguidance.grammar_from("grammar", text)


def lark(text: str) -> str:
    """A Lark grammar in llguidance's dialect (``%json {schema}`` embeds a JSON schema)."""
    return llguidance.grammar_from("lark", text)


def check(grammar: str) -> str | None:
    """None for a usable grammar, else llguidance's error message (one line where it gives one)."""
    try:
        message = llguidance.LLMatcher.validate_grammar(grammar)
    except (ValueError, RuntimeError) as e:
        return str(e)
    return message or None


def lark_string(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)
