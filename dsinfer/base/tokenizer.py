"""Tokenizer, chat template and incremental detokenizer for Hugging Face checkpoint directories.

Reads ``tokenizer.json`` with the ``tokenizers`` library (no transformers at serving time) and
reproduces what ``transformers.AutoTokenizer`` gives for the same directory by default:
``encode(text)`` equals ``AutoTokenizer(text)["input_ids"]`` and ``apply_chat_template`` equals
``apply_chat_template(..., tokenize=False)``. A rendered chat prompt already starts with bos, so
encode it with ``add_special_tokens=False`` (as transformers does when it tokenizes a chat).

A DeepSeek-V4 checkpoint (config.json's ``model_type``) has no Jinja template: its conversations
are written by its own encoder (dsinfer/base/chat_v4.py, ``chat_encoder`` "deepseek-v4"), which
a ``--chat-template`` file replaces as it would a template.
"""

from __future__ import annotations

import functools
import json
import math
import re
import re._parser as re_parser
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from dsinfer.base.chat_v4 import ChatEncodingError, render_v4_chat

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"
CHAT_ENCODERS = {"deepseek_v4": "deepseek-v4"}  # model_type -> the encoder its conversations need
TIKTOKEN_FILES = ("tiktoken.model",)
REPLACEMENT_CHAR = "\ufffd"


class TokenizerError(ValueError):
    """A tokenizer directory, file or chat template that cannot be used; the message names it."""


class ChatTemplateError(TokenizerError):
    """The chat template refused a conversation; ``reason`` is the template's own message (no
    server path: it may be shown to the client who sent the conversation)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: cannot read JSON: {e}") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return data


def _token_content(value: Any, path: Path, field: str) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, null, or {"content": ...}."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"{path}: field {field!r} must be a string or an object with 'content'")


def _config_ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (used by some templates): renders its body."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's Extension API

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, **kwargs: Any) -> str:
    """Unlike jinja2's tojson, no HTML escaping; indent, separators and sort_keys pass through."""
    return json.dumps(value, ensure_ascii=ensure_ascii, **kwargs)


def _compile_template(source: str, origin: str) -> jinja2.Template:
    """Compile in a sandbox with the settings and helpers transformers gives chat templates."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"{origin}: chat template syntax error at line {e.lineno}: {e.message}") from e


def _template_from_config(value: Any, path: Path) -> str | None:
    """tokenizer_config.json's ``chat_template``: a string, or a list of {"name", "template"}."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise TokenizerError(f"{path}: field 'chat_template' must be a string or a list with a 'default' entry")


class Tokenizer:
    """A checkpoint's tokenizer: encode, decode and chat template, as transformers does by default."""

    def __init__(
        self,
        backend: HFTokenizer,
        config: dict[str, Any] | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        origin: str = "<memory>",
        chat_encoder: str | None = None,
    ) -> None:
        config = config or {}
        if chat_encoder is not None and chat_encoder not in CHAT_ENCODERS.values():
            raise TokenizerError(f"unknown chat encoder {chat_encoder!r}")
        self.chat_encoder = None if chat_template else chat_encoder
        config_path = Path(origin) / TOKENIZER_CONFIG_FILE
        self.backend = backend
        self.origin = origin
        self.bos_token = _token_content(config.get("bos_token"), config_path, "bos_token")
        self.eos_token = _token_content(config.get("eos_token"), config_path, "eos_token")
        self.pad_token = _token_content(config.get("pad_token"), config_path, "pad_token")
        self.bos_token_id: int | None = self._special_id(self.bos_token, "bos_token")
        eos_id = self._special_id(self.eos_token, "eos_token")
        eos_ids = ([eos_id] if eos_id is not None else []) + list(extra_eos_token_ids)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_ids))
        self.pad_token_id: int | None = self._special_id(self.pad_token, "pad_token")
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.model_max_length: int | None = config.get("model_max_length")
        self.chat_template = chat_template
        self._template = _compile_template(chat_template, origin) if chat_template else None

        # What the post-processor adds around any text; add_bos/eos_token only fill in what it lacks.
        probe = backend.encode("", add_special_tokens=True).ids
        bos, eos = self.bos_token_id, eos_id
        add_bos = bool(config.get("add_bos_token")) and bos is not None and probe[:1] != [bos]
        add_eos = bool(config.get("add_eos_token")) and eos is not None and probe[-1:] != [eos]
        self._head: list[int] = [bos] if add_bos and bos is not None else []
        self._tail: list[int] = [eos] if add_eos and eos is not None else []

    def _special_id(self, token: str | None, field: str) -> int | None:
        if token is None:
            return None
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise TokenizerError(
                f"{Path(self.origin) / TOKENIZER_CONFIG_FILE}: {field} {token!r} is not in the vocabulary"
            )
        return token_id

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json (required), tokenizer_config.json, chat_template.jinja and the eos ids
        of generation_config.json (all optional) from a checkpoint directory."""
        directory = Path(path)
        if not directory.is_dir():
            raise TokenizerError(f"{directory}: tokenizer directory does not exist")
        tokenizer_file = directory / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            tiktoken = [name for name in TIKTOKEN_FILES if (directory / name).is_file()]
            if tiktoken:
                raise TokenizerError(
                    f"{directory}: tiktoken-based tokenizers (Kimi-K2, {tiktoken[0]}) are not supported yet; "
                    f"dsinfer needs a {TOKENIZER_FILE}"
                )
            raise TokenizerError(f"{directory}: {TOKENIZER_FILE} is missing")
        try:
            backend = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust side raises plain Exception
            raise TokenizerError(f"{tokenizer_file}: cannot load: {e}") from e

        config_path = directory / TOKENIZER_CONFIG_FILE
        config = _read_json(config_path) or {}
        template_path = directory / CHAT_TEMPLATE_FILE
        if template_path.is_file():
            template = template_path.read_text(encoding="utf-8")
        else:
            template = _template_from_config(config.get("chat_template"), config_path)
        generation = _read_json(directory / GENERATION_CONFIG_FILE) or {}
        model_type = (_read_json(directory / MODEL_CONFIG_FILE) or {}).get("model_type")
        encoder = CHAT_ENCODERS.get(model_type) if isinstance(model_type, str) else None
        return cls(
            backend,
            config,
            None if encoder else template,
            extra_eos_token_ids=_config_ids(generation.get("eos_token_id")),
            origin=str(directory),
            chat_encoder=encoder,
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The batch entry point releases the GIL while it works (``encode`` holds it throughout),
        # so a server tokenizing a long prompt on a thread keeps serving; same ids, no offsets.
        ids = self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
        return self._head + ids + self._tail if add_special_tokens else ids

    @functools.cached_property
    def max_token_chars(self) -> int | None:
        """The most characters of text one token can stand for, or None when no such bound
        holds (a normalizer that may shrink the text by an unknown factor). A text of ``c``
        characters has at least ``ceil(c / max_token_chars)`` tokens: a length check before
        tokenizing. Vocabulary entries spell one character per byte (byte-level BPE) or per
        character, so the longest entry bounds a token's text once normalized; a normalizer
        that keeps at least a fraction ``f`` of the characters widens the bound by ``1 / f``.
        Computed once, from the vocabulary."""
        factor = least_kept_fraction(json.loads(self.backend.to_str()).get("normalizer"))
        if factor is None:
            return None
        longest = max(len(token) for token in self.backend.get_vocab(with_added_tokens=True))
        return math.ceil(longest / factor)

    def least_tokens(self, text: str) -> int:
        """A lower bound on the number of tokens of ``text`` (0 when there is none), without
        tokenizing it."""
        per_token = self.max_token_chars
        return 0 if per_token is None else -(-len(text) // per_token)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render a conversation; extra keyword arguments (``tools``, ``thinking``...) reach the template
        (or the encoder: ``thinking``, ``reasoning_effort``, ``drop_thinking``)."""
        if self.chat_encoder is not None:
            try:
                return render_v4_chat(messages, add_generation_prompt, **kwargs)
            except ChatEncodingError as e:
                raise ChatTemplateError(f"DeepSeek-V4 chat encoding of {self.origin}: {e}", str(e)) from e
        if self._template is None:
            raise ChatTemplateError(
                f"{self.origin}: no chat template "
                f"({CHAT_TEMPLATE_FILE}, or 'chat_template' in {TOKENIZER_CONFIG_FILE})",
                "this model has no chat template",
            )
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token}
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables, **kwargs
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template of {self.origin}: {e}", str(e)) from e


def least_kept_fraction(normalizer: dict[str, Any] | None) -> float | None:
    """The least fraction of a text's characters that ``normalizer`` (tokenizer.json's) keeps,
    or None when it may keep arbitrarily few (or is of a kind not analysed here)."""
    if normalizer is None:
        return 1.0
    kind = normalizer.get("type")
    if kind == "Sequence":
        fraction = 1.0
        for member in normalizer.get("normalizers", []):
            kept = least_kept_fraction(member)
            if kept is None:
                return None
            fraction *= kept
        return fraction
    if kind == "Replace":
        longest = _longest_match(normalizer.get("pattern", {}))
        content = normalizer.get("content", "")
        if longest is None or not content:
            return None
        return min(1.0, len(content) / longest) if longest else 1.0
    # Normalizers that only ever add or change characters (decomposition, lowercasing...).
    return 1.0 if kind in ("NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel") else None


def _longest_match(pattern: dict[str, Any]) -> int | None:
    """The most characters a Replace pattern can match, or None when unbounded or unknown."""
    if isinstance(pattern.get("String"), str):
        return len(pattern["String"])
    if not isinstance(pattern.get("Regex"), str):
        return None
    try:  # Python's regex parser reads the simple patterns tokenizer.json files hold
        _, most = re_parser.parse(pattern["Regex"]).getwidth()
    except (re.error, RecursionError, OverflowError):
        return None
    return most if most < re_parser.MAXREPEAT else None


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    The concatenated deltas equal ``tokenizer.decode(all ids)``. A delta never ends inside a UTF-8
    character: while the decoded text ends with U+FFFD (bytes of a character still to come), the
    text is held back; ``flush()`` releases whatever is held at the end of the stream. Each step
    decodes only a short window: the previous delta's tokens as context plus the new ones, so
    tokenizers that drop a leading space at the start of a decode still join words correctly.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # everything emitted so far
        self._prefix = 0  # window start: context tokens already emitted
        self._read = 0  # tokens before this index are emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _emit(self, final: bool) -> str:
        window = self._decode(self.ids[self._prefix :])
        if window.endswith(REPLACEMENT_CHAR) and not final:
            return ""
        emitted = self._decode(self.ids[self._prefix : self._read])
        delta = window[len(emitted) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta

    def feed(self, ids: Iterable[int]) -> str:
        """Add token ids; return the new text (possibly empty)."""
        self.ids.extend(ids)
        if len(self.ids) == self._read:
            return ""
        return self._emit(final=False)

    def flush(self) -> str:
        """End of stream: return any text still held back (incomplete bytes decode to U+FFFD)."""
        if len(self.ids) == self._read:
            return ""
        return self._emit(final=True)
