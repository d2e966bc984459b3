"""Reading a JSON or YAML file whose problems are the caller's error, one line that names the file:
``{path}: no such {what} file`` or ``{path}: not valid JSON|YAML ({the parser's words})``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import yaml

_PARSERS: dict[str, tuple[Callable[[str], Any], type[Exception]]] = {
    "JSON": (json.loads, json.JSONDecodeError),
    "YAML": (yaml.safe_load, yaml.YAMLError),
}


def read_document(path: Path, syntax: Literal["JSON", "YAML"], what: str, error: type[Exception]) -> Any:
    """The parsed file; ``error`` (the caller's exception type) when it is missing or does not parse."""
    parse, parse_error = _PARSERS[syntax]
    try:
        return parse(path.read_text())
    except FileNotFoundError:
        raise error(f"{path}: no such {what} file") from None
    except parse_error as e:
        raise error(f"{path}: not valid {syntax} ({' '.join(str(e).split())})") from None
