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

from harness.tiny_tokenizer import (
    BOS,
    CHAT_TEMPLATE,
    SKIPPED_ON_DECODE,
    SPECIAL_TOKENS,
    TOOL_TOKENS,
    VOCAB_SIZE,
    tokenizer_config,
    write_json,
)

# Folders of the stdlib left out of the corpus: tests, vendored or demo code, installed packages.
EXCLUDED_DIRS = {"test", "tests", "site-packages", "idlelib", "lib2to3", "turtledemo", "__pycache__"}


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
