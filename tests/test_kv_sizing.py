"""The KV pool's default size: on a CPU what max_num_seqs x max_model_len need, capped by a
fraction of free memory; on a GPU that fraction. The engine and `--dry-run` use the same rule."""

from __future__ import annotations

import pytest

from dsinfer.cli.main import main
from dsinfer.engine.args import EngineArgs
from dsinfer.engine.engine import LLMEngine

PAGE = 64 * 9216  # bytes of one page of the tiny model (64 tokens x 4 layers x 576 float32)


def budget(args: EngineArgs, max_model_len: int, free: int, device: str = "cpu") -> tuple[int, str]:
    return args.default_kv_budget(
        page_bytes=PAGE, page_size=64, max_model_len=max_model_len, free=free, device_type=device
    )


def test_cpu_pool_holds_max_num_seqs_whole_sequences() -> None:
    size, note = budget(EngineArgs(max_num_seqs=4), max_model_len=130, free=64 * 2**30)
    assert size == 4 * 3 * PAGE  # 130 tokens take 3 pages
    assert "--max-num-seqs 4 x --max-model-len 130" in note


def test_cpu_pool_is_capped_by_the_fraction_of_free_memory() -> None:
    size, note = budget(EngineArgs(), max_model_len=4096, free=16 * 2**30)
    assert size == int(16 * 2**30 * 0.02) < 256 * 64 * PAGE
    assert "0.02 of free memory" in note and "less than" in note
    size, _ = budget(EngineArgs(kv_cache_memory_fraction=0.5), max_model_len=4096, free=16 * 2**30)
    assert size == 8 * 2**30


def test_gpu_pool_is_the_fraction_of_free_memory() -> None:
    size, _ = budget(EngineArgs(max_num_seqs=1), max_model_len=128, free=80 * 2**30, device="cuda")
    assert size == int(80 * 2**30 * 0.8)


def test_engine_sizes_its_pool_by_the_rule() -> None:
    engine = LLMEngine(EngineArgs(max_num_seqs=3, max_model_len=200))
    assert engine.kv_pages.num_pages == 3 * 4  # 200 tokens take 4 pages of 64
    engine.close()


def test_an_explicit_size_wins() -> None:
    engine = LLMEngine(EngineArgs(max_num_seqs=3, max_model_len=200, kv_cache_memory=10 * PAGE))
    assert engine.kv_pages.num_pages == 10
    engine.close()


def test_dry_run_shows_the_rule(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--dry-run", "--max-num-seqs", "8", "--max-model-len", "256"]) == 0
    out = capsys.readouterr().out
    assert "KV cache: 18.0 MiB (--max-num-seqs 8 x --max-model-len 256 (capped at 0.02 of free memory" in out
    assert "= 32 pages = 2048 tokens per rank" in out
