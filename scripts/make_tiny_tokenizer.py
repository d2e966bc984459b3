"""Train the built-in tiny model's tokenizer and write it to configs/models/tiny/.

A byte-level BPE of exactly 4096 entries (special tokens included) trained with the ``tokenizers``
library on the docstrings of the Python standard library that ships with the interpreter running
this script. The corpus is read in sorted file order and training is deterministic, so the same
interpreter reproduces the same files byte for byte.

Special tokens use DeepSeek-V3's spelling (fullwidth bars, U+2581 for spaces). As in DeepSeek-V3,
only bos and eos are "special" (skipped by ``decode(skip_special_tokens=True)``); the role,
reasoning and tool-call markers are added tokens that are never split but are kept in decoded
text. The tool-call markers (``TOOL_TOKENS``) take the last ids: the BPE is trained to
``VOCAB_SIZE - len(TOOL_TOKENS)`` entries and they are added after it.

The chat template is built from fragments (``TOOLS_SYSTEM``, ``TOOL_CALLS``, ``TOOL_OUTPUT``):
any preset template of this family can include the same tool rendering (DeepSeek-V3's format,
which ``--tool-call-parser deepseek-v3`` reads).

Usage: python scripts/make_tiny_tokenizer.py [--out DIR]
"""

from __future__ import annotations

import argparse
import ast
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 4096
MODEL_MAX_LENGTH = 4096
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
END_THINK = "</think>"
SPECIAL_TOKENS = [BOS, EOS, USER, ASSISTANT, THINK, END_THINK]
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
OUTPUTS_BEGIN, OUTPUTS_END = "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>"
OUTPUT_BEGIN, OUTPUT_END = "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
TOOL_TOKENS = [
    CALLS_BEGIN,
    CALLS_END,
    CALL_BEGIN,
    CALL_END,
    OUTPUTS_BEGIN,
    OUTPUTS_END,
    OUTPUT_BEGIN,
    OUTPUT_END,
    TOOL_SEP,
]
SKIPPED_ON_DECODE = {BOS, EOS}

# Folders of the stdlib left out of the corpus: tests, vendored or demo code, installed packages.
EXCLUDED_DIRS = {"test", "tests", "site-packages", "idlelib", "lib2to3", "turtledemo", "__pycache__"}

# Tool rendering, DeepSeek-V3's format: the tools are described after the system prompt; an
# assistant turn's calls are <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME, its
# arguments in a json code fence, <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>; tool results follow as
# <｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>...<｜tool▁output▁end｜>...<｜tool▁outputs▁end｜>,
# after which the assistant goes on without a new <｜Assistant｜>. Each fragment expects ``ns``
# (a namespace with ``system`` and ``is_tool``) and ``message``.
TOOLS_SYSTEM = """\
{%- if tools is defined and tools -%}
    {%- if ns.system -%}{%- set ns.system = ns.system + '\\n\\n' -%}{%- endif -%}
    {%- set ns.system = ns.system + '## Tools\\nYou have access to the following tools:\\n' -%}
    {%- for tool in tools -%}
        {%- set fn = tool['function'] if tool['function'] is defined else tool -%}
        {%- set ns.system = ns.system + '\\n### ' + fn['name'] + '\\nDescription: ' + (fn['description'] or '') + '\\n\\nParameters: ' + ((fn['parameters'] or {}) | tojson) + '\\n' -%}
    {%- endfor -%}
    {%- set ns.system = ns.system + '\\nTo call tools, answer with <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGUMENTS\\n```<｜tool▁call▁end｜> (one such call per tool, chained) and end with <｜tool▁calls▁end｜>.\\n' -%}
{%- endif -%}
"""
TOOL_CALLS = """\
{%- for call in message['tool_calls'] -%}
    {%- set args = call['function']['arguments'] -%}
    {{ ('<｜tool▁calls▁begin｜>' if loop.first else '') + '<｜tool▁call▁begin｜>' + (call['type'] or 'function') + '<｜tool▁sep｜>' + call['function']['name'] + '\\n```json\\n' + (args if args is string else args | tojson) + '\\n```<｜tool▁call▁end｜>' }}
{%- endfor -%}
{{ '<｜tool▁calls▁end｜>' }}
"""
TOOL_OUTPUT = """\
{{ ('<｜tool▁outputs▁begin｜>' if not ns.is_tool else '') + '<｜tool▁output▁begin｜>' + content + '<｜tool▁output▁end｜>' }}
"""

# DeepSeek-V3-style chat template: system prompts first (joined by blank lines), then the tools,
# then each turn behind its role marker; assistant turns end with eos. Reasoning before </think>
# is dropped from assistant turns in the history, as DeepSeek-R1's template does.
CHAT_TEMPLATE = (
    """\
{%- set ns = namespace(system='', is_tool=false) -%}
{%- for message in messages -%}
    {%- if message['role'] == 'system' -%}
        {%- if ns.system -%}{%- set ns.system = ns.system + '\\n\\n' -%}{%- endif -%}
        {%- set ns.system = ns.system + message['content'] -%}
    {%- endif -%}
{%- endfor -%}
"""
    + TOOLS_SYSTEM
    + """\
{{ bos_token }}{{ ns.system }}
{%- for message in messages -%}
    {%- set content = message['content'] or '' -%}
    {%- if content is not string -%}
        {%- set texts = content | selectattr('type', 'equalto', 'text') | map(attribute='text') -%}
        {%- set content = texts | join('') -%}
    {%- endif -%}
    {%- if message['role'] != 'tool' and ns.is_tool -%}
        {{ '<｜tool▁outputs▁end｜>' }}
    {%- endif -%}
    {%- if message['role'] == 'user' -%}
        {{ '<｜User｜>' + content }}
    {%- elif message['role'] == 'assistant' -%}
        {%- if '</think>' in content -%}
            {%- set content = content.split('</think>')[-1] -%}
        {%- endif -%}
        {{ ('' if ns.is_tool else '<｜Assistant｜>') + content }}
        {%- if message['tool_calls'] is defined and message['tool_calls'] -%}
"""
    + TOOL_CALLS
    + """\
        {%- endif -%}
        {{ eos_token }}
    {%- elif message['role'] == 'tool' -%}
"""
    + TOOL_OUTPUT
    + """\
    {%- elif message['role'] != 'system' -%}
        {{ raise_exception('Unsupported chat role: ' + message['role']) }}
    {%- endif -%}
    {%- set ns.is_tool = message['role'] == 'tool' -%}
{%- endfor -%}
{%- if ns.is_tool -%}
    {{ '<｜tool▁outputs▁end｜>' }}
{%- elif add_generation_prompt -%}
    {{ '<｜Assistant｜>' }}
{%- endif -%}
"""
)


def stdlib_docstrings() -> Iterator[str]:
    """Every module, class and function docstring of the stdlib, in sorted file order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if EXCLUDED_DIRS.intersection(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    yield doc


def build_tokenizer(corpus: Iterator[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    # Digits in groups of at most three (as DeepSeek-V3 does), then GPT-2 style byte-level words.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(TOOL_TOKENS),
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    tokenizer.add_tokens(TOOL_TOKENS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0",
        pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
        special_tokens=[(BOS, 0)],
    )
    return tokenizer


def tokenizer_json(tokenizer: Tokenizer) -> dict:
    """The tokenizer as JSON, with only bos and eos marked special (DeepSeek-V3's choice)."""
    data = json.loads(tokenizer.to_str())
    for entry in data["added_tokens"]:
        entry["special"] = entry["content"] in SKIPPED_ON_DECODE
        entry["normalized"] = False
    return data


def tokenizer_config() -> dict:
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": MODEL_MAX_LENGTH,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")


def main() -> None:
    default_out = Path(__file__).resolve().parent.parent / "configs" / "models" / "tiny"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=default_out, help="output directory")
    args = parser.parse_args()

    tokenizer = build_tokenizer(stdlib_docstrings())
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != VOCAB_SIZE:
        raise SystemExit(f"trained vocabulary has {size} entries, expected {VOCAB_SIZE}: corpus too small")
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == token_id, token
    for token_id, token in enumerate(TOOL_TOKENS, start=VOCAB_SIZE - len(TOOL_TOKENS)):
        assert tokenizer.token_to_id(token) == token_id, token

    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "tokenizer.json", tokenizer_json(tokenizer))
    write_json(args.out / "tokenizer_config.json", tokenizer_config())
    (args.out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    print(f"wrote tokenizer.json ({size} entries), tokenizer_config.json, chat_template.jinja to {args.out}")


if __name__ == "__main__":
    main()
