"""The built-in tiny models' tokenizer as scripts/make_tiny_tokenizer.py trains it and
scripts/train_tiny.py extends it: DeepSeek-V3's special tokens and tool-call markers, the chat
template (built from fragments that any preset template of this family can include) and
tokenizer_config.json."""

from __future__ import annotations

import json
from pathlib import Path

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
