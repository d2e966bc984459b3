"""Model presets shipped with the package (configs/models/<name>/, installed as ``dsinfer.presets``).

A preset is a checkpoint directory: ``tiny-chat`` (the default) is a trained model with its
weights and tokenizer (scripts/train_tiny.py); the others are config.json only (``tiny`` with a
tokenizer) and run with dummy weights.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

DEFAULT_MODEL = "tiny-chat"
RANDOM_MODEL = "tiny"  # the random-weight model of the same family, for tests and benchmarks


def presets_dir() -> Path:
    return Path(str(resources.files("dsinfer.presets")))


def preset_names() -> list[str]:
    return sorted(p.name for p in presets_dir().iterdir() if (p / "config.json").is_file())


def resolve_model(source: str | Path | None) -> tuple[Path, bool]:
    """-> (checkpoint directory, whether it is a built-in preset). None means DEFAULT_MODEL."""
    if source is None:
        source = DEFAULT_MODEL
    path = Path(source)
    if path.is_dir():
        return path, path.resolve().parent == presets_dir().resolve()
    preset = presets_dir() / str(source)
    if (preset / "config.json").is_file():
        return preset, True
    raise FileNotFoundError(
        f"model {str(source)!r} is neither a checkpoint directory nor a preset ({', '.join(preset_names())})"
    )
