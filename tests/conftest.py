"""Shared pytest fixtures: tiny DeepSeek-V3 checkpoints built once per session; the openai client of a module's server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

from harness.checkpoints import (
    FP8_OVERRIDES,
    V32_OVERRIDES,
    YARN_V3,
    BuiltCheckpoint,
    build_checkpoint,
)
from harness.server import Server

if TYPE_CHECKING:  # the client's package is needed only by tests that talk to a server through it
    import openai


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> BuiltCheckpoint:
    """TINY_BASE, float32, MTP layer, 2 shards, positive router bias, tokenizer files if present."""
    return build_checkpoint(tmp_path_factory.mktemp("tiny_ckpt"), bias_scale=0.5)


@pytest.fixture(scope="session")
def tiny_ckpt_fp8(tmp_path_factory: pytest.TempPathFactory) -> BuiltCheckpoint:
    """TINY_BASE + FP8_OVERRIDES with block-FP8 weights (full and partial 128x128 blocks), MTP, 2 shards."""
    return build_checkpoint(tmp_path_factory.mktemp("tiny_ckpt_fp8"), FP8_OVERRIDES, fp8=True, bias_scale=0.5)


@pytest.fixture(scope="session")
def tiny_ckpt_v32(tmp_path_factory: pytest.TempPathFactory) -> BuiltCheckpoint:
    """A tiny DeepSeek-V3.2 (DeepseekV32ForCausalLM: 12 keys per query picked by a 16-head indexer),
    float32, MTP layer, 1024 positions (YaRN x4 over 256), tokenizer files."""
    overrides = {
        **V32_OVERRIDES,
        "max_position_embeddings": 1024,
        "rope_scaling": {**YARN_V3, "original_max_position_embeddings": 256},
    }
    return build_checkpoint(tmp_path_factory.mktemp("tiny_ckpt_v32"), overrides, bias_scale=0.5)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    """The official ``openai`` client of the module's ``server`` fixture (no retries)."""
    return server.openai_client()


@pytest.fixture
def closing() -> Iterator[list[Any]]:
    """The processes a test starts (each with ``close()``), closed when it ends, however it ends."""
    started: list[Any] = []
    try:
        yield started
    finally:
        for process in started:
            process.close()
