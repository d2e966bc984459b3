"""Tool-call parsers under malformed output (issue: fuzz DSML through the parser): every format's
valid text, mutated thousands of ways (truncated at any character, markers cut in half, repeated
or nested, bad JSON in arguments, stray text between markers), whole and streamed in random
pieces, cut by a length limit or not. No exception escapes; streamed equals whole; text without
a section marker comes back as it is; DSML arguments are always a JSON object."""

from __future__ import annotations

import json
import random

import pytest

from dsinfer.gateway.tool_parsers import PARSERS, tool_format
from tests.test_tool_parsers import TEXTS

CASES = 3000  # per format and mode: a few seconds in all


def _markers(name: str) -> list[str]:
    fmt = tool_format(name)
    return [
        m for m in (fmt.section_begin, fmt.section_end, fmt.call_begin, fmt.args_begin, fmt.args_end) if m
    ]


def _mutate(text: str, markers: list[str], rng: random.Random) -> str:
    for _ in range(rng.randint(1, 3)):
        kind = rng.randrange(6)
        at = rng.randint(0, len(text))
        if kind == 0:  # truncated anywhere
            text = text[:at]
        elif kind == 1:  # half a marker
            marker = rng.choice(markers)
            text = text[:at] + marker[: rng.randint(1, len(marker))] + text[at:]
        elif kind == 2:  # a marker repeated or nested
            text = text[:at] + rng.choice(markers) + text[at:]
        elif kind == 3:  # bad JSON in the arguments
            text = text.replace("}", rng.choice(["", "}}", ",}", '"']), 1).replace(
                '"UTC"', rng.choice(["UTC", '"UTC', "{"])
            )
        elif kind == 4:  # stray text
            text = (
                text[:at] + rng.choice(["x", "\n", " ", '"', "<", "｜", ">"]) * rng.randint(1, 3) + text[at:]
            )
        else:  # a whole second section
            text = text + text
    return text


def _parse(name: str, text: str, pieces: list[str], cut: bool) -> tuple[str, list[tuple[str, str]]]:
    parser = tool_format(name).parser()
    content = ""
    for piece in pieces:
        content += parser.feed(piece)[0]
    content += parser.flush(cut)[0]
    return content, [(c.name, c.arguments) for c in parser.calls]


def _pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("cut", [False, True])
@pytest.mark.parametrize("name", sorted(PARSERS))
def test_malformed_calls_never_raise_and_stream_as_whole(name: str, cut: bool) -> None:
    rng = random.Random(f"{name}/{cut}")
    fmt, markers = tool_format(name), _markers(name)
    for _ in range(CASES):
        text = _mutate(TEXTS[name], markers, rng)
        whole = _parse(name, text, [text], cut)
        assert _parse(name, text, _pieces(text, rng), cut) == whole, text
        content, calls = whole
        if fmt.section_begin not in text and not cut:
            assert content == text
        if not fmt.stream_arguments:  # DSML: arguments become JSON at the call's end
            for _, arguments in calls:
                assert isinstance(json.loads(arguments), dict), (text, arguments)
