"""`dsinfer generate` end to end in a subprocess: the built-in tiny model, a checkpoint directory
against transformers' greedy tokens, and one-line errors for bad checkpoints."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from harness.checkpoints import (
    BuiltCheckpoint,
    build_checkpoint,
    drop_tensor,
    reshape_tensor,
    set_config_field,
    truncate_shard,
)
from harness.hf_reference import compare_tokens, hf_greedy_steps
from harness.server import run_dsinfer

pytestmark = pytest.mark.system

TIMEOUT = 180


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_dsinfer(*args, timeout=TIMEOUT)


def generate_json(*args: str) -> dict:
    result = run_cli("generate", "--json", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_builtin_random_tiny_model() -> None:
    first = generate_json("--model", "tiny", "--prompt", "Hello, DeepSeek", "--max-tokens", "6")
    assert len(first["token_ids"]) == 6 and isinstance(first["text"], str)
    assert (
        generate_json("--model", "tiny", "--prompt", "Hello, DeepSeek", "--max-tokens", "6") == first
    )  # dummy weights are seeded
    plain = run_cli("generate", "--model", "tiny", "--prompt", "Hello, DeepSeek", "--max-tokens", "6")
    assert plain.returncode == 0 and plain.stdout.strip() == first["text"].strip()
    assert (
        plain.stderr.strip().splitlines()[-1]
        == "dsinfer: the output stopped at --max-tokens 6 (finish_reason length)"
    )


def test_builtin_default_model_is_trained() -> None:
    """The default model answers a chat-formatted question right (the special tokens are parsed)."""
    plain = run_cli("generate", "--prompt", "<｜User｜>What is 17 + 25?<｜Assistant｜>", "--max-tokens", "8")
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.strip() == "42", plain.stdout


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> BuiltCheckpoint:
    return build_checkpoint(tmp_path_factory.mktemp("cli"), bias_scale=0.3, seed=21)


def test_checkpoint_tokens_equal_transformers(ckpt: BuiltCheckpoint) -> None:
    prompt = "The quick brown fox jumps over the lazy dog."
    out = generate_json("--model", str(ckpt.path), "--prompt", prompt, "--max-tokens", "12")
    input_ids = AutoTokenizer.from_pretrained(str(ckpt.path))(prompt)["input_ids"]
    ref_tokens, ref_logits = hf_greedy_steps(ckpt.hf_model, input_ids, 12, eos_ids=(1,))
    compare_tokens(ref_tokens, out["token_ids"], ref_logits)


def _bad_copy(ckpt: BuiltCheckpoint, tmp_path: Path) -> Path:
    bad = tmp_path / "bad"
    shutil.copytree(ckpt.path, bad)
    return bad


def _assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("dsinfer: error:"), last
    for needle in needles:
        assert needle in last, last


def _generate(path: Path) -> subprocess.CompletedProcess[str]:
    return run_cli("generate", "--model", str(path), "--prompt", "hi", "--max-tokens", "2")


def test_missing_tensor(ckpt: BuiltCheckpoint, tmp_path: Path) -> None:
    bad = _bad_copy(ckpt, tmp_path)
    drop_tensor(bad, "model.layers.1.mlp.experts.3.up_proj.weight")
    _assert_one_line_error(_generate(bad), "missing tensor model.layers.1.mlp.experts.3.up_proj.weight")


def test_wrong_shape(ckpt: BuiltCheckpoint, tmp_path: Path) -> None:
    bad = _bad_copy(ckpt, tmp_path)
    reshape_tensor(bad, "model.layers.0.self_attn.kv_b_proj.weight", (32, 32))
    _assert_one_line_error(_generate(bad), "model.layers.0.self_attn.kv_b_proj.weight", "shape [32, 32]")


def test_unknown_model_type(ckpt: BuiltCheckpoint, tmp_path: Path) -> None:
    bad = _bad_copy(ckpt, tmp_path)
    set_config_field(bad, "model_type", "mixtral")
    _assert_one_line_error(_generate(bad), "model_type 'mixtral' (DeepseekV3ForCausalLM) is not supported")


def test_unsupported_family_ends_generate_and_serve(tmp_path: Path) -> None:
    """A Qwen3-MoE config.json: one line naming its model_type, before any field (or process); a
    DeepSeek-V4 one missing its fields: one line naming them."""
    qwen = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 4096}
    (tmp_path / "config.json").write_text(json.dumps(qwen))
    needle = "model_type 'qwen3_moe' (Qwen3MoeForCausalLM) is not supported; dsinfer serves deepseek_v3"
    _assert_one_line_error(_generate(tmp_path), needle)
    serve = run_cli("serve", "--model", str(tmp_path), "--port", "0")
    _assert_one_line_error(serve, needle)
    assert len(serve.stderr.strip().splitlines()) == 1, serve.stderr
    v4 = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 7168}
    (tmp_path / "config.json").write_text(json.dumps(v4))
    for done in (_generate(tmp_path), run_cli("serve", "--model", str(tmp_path), "--port", "0")):
        _assert_one_line_error(done, "DeepSeek-V4 config: vocab_size: Field required")


def test_truncated_safetensors(ckpt: BuiltCheckpoint, tmp_path: Path) -> None:
    bad = _bad_copy(ckpt, tmp_path)
    shard = truncate_shard(bad, 4096)
    _assert_one_line_error(_generate(bad), shard.name, "truncated or corrupt")


def test_kimi_tiktoken_tokenizer_is_refused_clearly(ckpt: BuiltCheckpoint, tmp_path: Path) -> None:
    bad = _bad_copy(ckpt, tmp_path)
    set_config_field(bad, "model_type", "kimi_k2")
    (bad / "tokenizer.json").unlink()
    (bad / "tiktoken.model").write_text("")
    _assert_one_line_error(_generate(bad), "tiktoken", "not supported")


def test_bad_arguments() -> None:
    _assert_one_line_error(run_cli("generate", "--prompt", "x", "--max-tokens", "0"), "--max-tokens")
    _assert_one_line_error(run_cli("generate", "--model", "no-such-model", "--prompt", "x"), "no-such-model")
