"""dsinfer.base.tokenizer against transformers on the built-in tiny model's tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from dsinfer.base.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError

TINY = Path(__file__).resolve().parent.parent / "configs" / "models" / "tiny"
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
TEXTS = [
    "",
    "Hello, world! The quick brown fox jumps over 1234567 lazy dogs.",
    "  leading and trailing spaces\n\ttabs\n",
    "héllo wörld — naïve café",
    "你好，世界！深度求索 DeepSeek-V3",
    "emoji 🤗🚀👩‍💻 and symbols ∑∫√",
    "<｜User｜>hi<｜Assistant｜><think>hmm</think>ok<｜end▁of▁sentence｜>",
]
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "<think>Add them.</think>4"},
    {"role": "user", "content": "And 3 + 3? 你好"},
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(TINY)


@pytest.fixture(scope="module")
def hf_tok() -> Any:  # a transformers tokenizer
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(TINY))


def test_tiny_tokenizer_shape(tok: Tokenizer) -> None:
    config = json.loads((TINY / "config.json").read_text())
    assert tok.vocab_size == config["vocab_size"] == 4096
    assert tok.bos_token_id == config["bos_token_id"] == 0
    assert tok.eos_token_ids == (config["eos_token_id"],) == (1,)
    assert tok.pad_token_id == 1
    for i, token in enumerate([BOS, EOS, "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]):
        assert tok.token_to_id(token) == i


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    assert tok.encode(text) == hf_tok(text)["input_ids"]
    assert tok.encode(text, add_special_tokens=False) == hf_tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=False) == BOS + text
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text.replace(EOS, "")


def test_bos_prepended_once(tok: Tokenizer) -> None:
    assert tok.encode("") == [0]
    ids = tok.encode("hello")
    assert ids[0] == 0 and 0 not in ids[1:]
    assert tok.encode("hello", add_special_tokens=False) == ids[1:]


def test_add_bos_token_fills_in_for_missing_post_processor(tmp_path: Path) -> None:
    data = json.loads((TINY / "tokenizer.json").read_text(encoding="utf-8"))
    data["post_processor"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    shutil.copy(TINY / "tokenizer_config.json", tmp_path)
    config = json.loads((TINY / "tokenizer_config.json").read_text(encoding="utf-8"))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.encode("hi") == Tokenizer.from_dir(TINY).encode("hi")
    config["add_bos_token"], config["add_eos_token"] = False, True
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    ids = Tokenizer.from_dir(tmp_path).encode("hi")
    assert ids[0] != 0 and ids[-1] == 1


def test_chat_template_matches_transformers(tok: Tokenizer, hf_tok: Any) -> None:
    for add_generation_prompt in (True, False):
        ours = tok.apply_chat_template(CONVERSATION, add_generation_prompt=add_generation_prompt)
        theirs = hf_tok.apply_chat_template(
            CONVERSATION, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours == theirs
    expected = (
        f"{BOS}You are a helpful assistant.<｜User｜>What is 2 + 2?<｜Assistant｜>4{EOS}"
        "<｜User｜>And 3 + 3? 你好<｜Assistant｜>"
    )
    assert tok.apply_chat_template(CONVERSATION) == expected


def test_chat_template_inline_equals_file(tok: Tokenizer) -> None:
    config = json.loads((TINY / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["chat_template"] == (TINY / "chat_template.jinja").read_text(encoding="utf-8")
    assert tok.chat_template == config["chat_template"]


def test_chat_template_errors(tok: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="Unsupported chat role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])
    shutil.copy(TINY / "tokenizer.json", tmp_path)
    with pytest.raises(TokenizerError, match="no chat template"):
        Tokenizer.from_dir(tmp_path).apply_chat_template(CONVERSATION)
    (tmp_path / "chat_template.jinja").write_text("{% if %}", encoding="utf-8")
    with pytest.raises(TokenizerError, match="syntax error"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("text", TEXTS[1:])
def test_incremental_detokenizer(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    for step in (1, 3):
        detok = IncrementalDetokenizer(tok)
        deltas = [detok.feed(ids[i : i + step]) for i in range(0, len(ids), step)]
        deltas.append(detok.flush())
        assert "".join(deltas) == tok.decode(ids) == detok.text
        assert not any("\ufffd" in d for d in deltas)


def test_incremental_detokenizer_holds_partial_characters(tok: Tokenizer) -> None:
    ids = tok.encode("🤗", add_special_tokens=False)
    assert len(ids) > 1  # a 4-byte character the tiny vocabulary splits
    detok = IncrementalDetokenizer(tok)
    assert [detok.feed([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.feed(ids[-1:]) == "🤗"
    detok = IncrementalDetokenizer(tok)
    detok.feed(ids[:1])
    assert detok.flush() == "\ufffd"  # an unfinished character is released at the end


def test_kimi_style_dir_is_refused(tmp_path: Path) -> None:
    (tmp_path / "tiktoken.model").write_text("", encoding="utf-8")
    (tmp_path / "tokenization_kimi.py").write_text("", encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"tiktoken-based tokenizers \(Kimi-K2") as info:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer\.json is missing") as info:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path) in str(info.value)
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "nope")


def test_bad_files_are_named(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: cannot load"):
        Tokenizer.from_dir(tmp_path)
    shutil.copy(TINY / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<nope>"}', encoding="utf-8")
    with pytest.raises(
        TokenizerError, match=r"tokenizer_config\.json: eos_token '<nope>' is not in the vocabulary"
    ):
        Tokenizer.from_dir(tmp_path)


def test_generation_config_eos_ids(tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / name, tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [1, 3]}', encoding="utf-8")
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == (1, 3)
