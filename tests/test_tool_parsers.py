"""Tool-call parsers on fixed texts in each model family's format, whole and streamed (one character
at a time, and in chunks that split the markers), and their grammars accepting what they parse."""

from __future__ import annotations

import json

import llguidance
import pytest

from dsinfer.gateway.tool_parsers import PARSERS, ToolCallDelta, ToolSpec, tool_format

WEATHER = {"location": "Tokyo, Japan", "unit": "celsius"}
TIME = {"tz": "UTC"}

TEXTS = {
    "deepseek-v3": (
        "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        + json.dumps(WEATHER)
        + "\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n"
        + json.dumps(TIME)
        + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    ),
    "deepseek-v3.1": (
        "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        + json.dumps(WEATHER)
        + "<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>"
        + json.dumps(TIME)
        + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    ),
    "deepseek-v3.2": (
        "Let me check.\n\n<｜DSML｜function_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="location" string="true">Tokyo, Japan</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="unit" string="true">celsius</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="get_time">\n'
        '<｜DSML｜parameter name="tz" string="false">"UTC"</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        "</｜DSML｜function_calls>"
    ),
    "kimi-k2": (
        "Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        "<|tool_call_argument_begin|>"
        + json.dumps(WEATHER)
        + "<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>"
        + json.dumps(TIME)
        + "<|tool_call_end|><|tool_calls_section_end|>"
    ),
}
TEXTS["deepseek-v4"] = TEXTS["deepseek-v3.2"].replace("function_calls", "tool_calls")  # V4 renamed the block
CONTENT = {
    name: "Let me check." if name != "deepseek-v3.2" else "Let me check.\n\n" for name in TEXTS
}  # V4: its lead


def _stream(name: str, pieces: list[str]) -> tuple[str, list[tuple[str | None, str | None, str]]]:
    """Content, and per call (id, name, arguments) assembled from the deltas as a client does."""
    parser = tool_format(name).parser()
    content, deltas = "", []
    for piece in pieces:
        text, new = parser.feed(piece)
        content += text
        deltas.extend(new)
    text, new = parser.flush()
    content += text
    deltas.extend(new)
    calls: dict[int, list] = {}
    for d in deltas:
        assert isinstance(d, ToolCallDelta)
        if d.index not in calls:
            assert d.id is not None and d.name is not None, "a call's first delta names it"
            calls[d.index] = [d.id, d.name, ""]
        calls[d.index][2] += d.arguments
    return content, [tuple(c) for _, c in sorted(calls.items())]


def test_every_registered_parser_is_tested() -> None:
    assert set(TEXTS) == set(PARSERS)


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_whole_text(name: str) -> None:
    content, calls = tool_format(name).parse(TEXTS[name])
    assert content == CONTENT[name]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", WEATHER),
        ("get_time", TIME),
    ]
    assert len({c.id for c in calls}) == 2
    if name == "kimi-k2":
        assert [c.id for c in calls] == ["functions.get_weather:0", "functions.get_time:1"]


@pytest.mark.parametrize("name", sorted(TEXTS))
@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_streamed(name: str, chunk: int) -> None:
    text = TEXTS[name]
    content, calls = _stream(name, [text[i : i + chunk] for i in range(0, len(text), chunk)])
    assert content == CONTENT[name]
    assert [(n, json.loads(a)) for _, n, a in calls] == [("get_weather", WEATHER), ("get_time", TIME)]


@pytest.mark.parametrize("name", ["deepseek-v3", "deepseek-v3.1", "kimi-k2"])
def test_arguments_stream_as_generated(name: str) -> None:
    """Before the call ends, the deltas already carry most of its arguments."""
    text = TEXTS[name]
    cut = text.index('"celsius"')
    parser = tool_format(name).parser()
    _, deltas = parser.feed(text[:cut])
    sent = "".join(d.arguments for d in deltas if d.index == 0)
    assert sent and json.dumps(WEATHER).startswith(sent)


def test_no_call_is_all_content() -> None:
    for name in TEXTS:
        text = "Plain answer with a < sign and <｜User｜> tokens."
        assert _stream(name, list(text)) == (text, [])
        assert tool_format(name).parse(text) == (text, [])


def test_call_the_output_ended_in_keeps_its_arguments() -> None:
    """The model ended (not max_tokens) before the call's end marker: the call stands."""
    text = TEXTS["deepseek-v3.1"]
    cut = text.index("<｜tool▁call▁end｜>")
    content, calls = tool_format("deepseek-v3.1").parse(text[:cut])
    assert content == "Let me check." and calls[0].arguments == json.dumps(WEATHER)


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_call_cut_by_max_tokens_is_the_text_before_it(name: str) -> None:
    """Cut anywhere from inside the section's begin marker to inside the first call's arguments:
    no partial marker in the content, no call; whole and streamed one character at a time."""
    fmt, text = tool_format(name), TEXTS[name]
    begin = text.index(fmt.section_begin)
    first_call_end = text.index(fmt.args_end) + len(fmt.args_end)
    for cut in range(begin + 1, first_call_end):
        assert fmt.parse(text[:cut], cut=True) == (CONTENT[name], []), text[:cut]
        parser = fmt.parser()
        content = "".join(parser.feed(c)[0] for c in text[:cut]) + parser.flush(cut=True)[0]
        assert (content, parser.calls) == (CONTENT[name], []), text[:cut]
    content, calls = fmt.parse(text[:first_call_end], cut=True)
    assert content == CONTENT[name] and [c.name for c in calls] == ["get_weather"]


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_grammar_accepts_a_call_and_parses(name: str) -> None:
    """The grammar of a required call: its language is what the parser reads (checked at the
    byte level with llguidance's validator and a matcher over a byte tokenizer)."""
    fmt = tool_format(name)
    tools = [
        ToolSpec("get_weather", {"type": "object", "properties": {"location": {"type": "string"}}}),
        ToolSpec("get_time", {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}}),
    ]
    grammar = llguidance.grammar_from("lark", fmt.grammar(tools, parallel=True, token_id=lambda text: None))
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    header = {"kimi-k2": "functions.get_time:0", "deepseek-v3": "function<｜tool▁sep｜>get_time"}.get(
        name, '"get_time"' if name in ("deepseek-v3.2", "deepseek-v4") else "get_time"
    )
    arguments = '{"tz":"CET"}'
    if name == "deepseek-v4":  # parameters, one per line; a value that is not a string is JSON
        arguments = '\n<｜DSML｜parameter name="tz" string="false">"CET"</｜DSML｜parameter>\n'
    call = fmt.call_begin + header + fmt.args_begin + arguments + fmt.args_end
    text = fmt.lead + fmt.section_begin + fmt.gap + call + fmt.gap + fmt.section_end
    tokenizer = llguidance.LLTokenizer(_byte_tokenizer_json())
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    assert matcher.consume_tokens(list(text.encode())), matcher.get_error()
    assert matcher.is_accepting()
    _, calls = fmt.parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"tz": "CET"})]


def test_kimi_call_index_is_bounded() -> None:
    """A forced Kimi call's index has at most MAX_INDEX_DIGITS digits: the call always gets to its
    arguments, whatever the sampled digits."""
    from dsinfer.gateway.tool_parsers.kimi import MAX_INDEX_DIGITS

    fmt = tool_format("kimi-k2")
    tools = [ToolSpec("get_time", {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}})]
    grammar = llguidance.grammar_from("lark", fmt.grammar(tools, parallel=False, token_id=lambda text: None))
    tokenizer = llguidance.LLTokenizer(_byte_tokenizer_json())
    head = fmt.section_begin + fmt.call_begin + "functions.get_time:"
    longest = llguidance.LLMatcher(tokenizer, grammar)
    assert longest.consume_tokens(list((head + "9" * MAX_INDEX_DIGITS + fmt.args_begin).encode()))
    longer = llguidance.LLMatcher(tokenizer, grammar)
    assert longer.consume_tokens(list((head + "9" * MAX_INDEX_DIGITS).encode()))
    assert not longer.consume_token(ord("9"))


def _byte_tokenizer_json() -> str:
    """A tokenizer whose 256 tokens are the bytes (GPT-2's byte -> character map), plus eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = {b: chr(b) for b in printable}
    for extra, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + extra)
    vocab = {chars[b]: b for b in range(256)} | {"<eos>": 256}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return tok.to_str()
