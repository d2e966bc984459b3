"""scripts/train_tiny.py is deterministic for a seed: two short runs write the same checkpoint, bit
for bit, and transformers loads it (the MTP layer stored as model.layers.<num_hidden_layers>.*)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import DeepseekV3ForCausalLM

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "train_tiny.py"
SHORT_RUN = [
    *("--steps", "2", "--seed", "3", "--threads", "1", "--warmup", "1"),
    *("--short-rows", "2", "--lookup-rows", "1", "--log-every", "1", "--eval-every", "2", "--eval-size", "1"),
]


def _train(out: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), "--out", str(out), *SHORT_RUN],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def test_same_seed_same_checkpoint(tmp_path: Path) -> None:
    runs = [_train(tmp_path / name) for name in ("a", "b")]
    logs = []
    try:
        for run in runs:
            out, _ = run.communicate(timeout=600)
            logs.append(out.decode())
            assert run.returncode == 0, logs[-1][-3000:]
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.wait(timeout=10)
    # the progress lines (losses, held-out evaluation) agree too, all but their timings
    progress = [
        [
            re.sub(r" [0-9]+ tok/s.*", "", line)
            for line in log.splitlines()
            if line.startswith(("step", "eval"))
        ]
        for log in logs
    ]
    assert progress[0] == progress[1] and any(line.startswith("eval step 2") for line in progress[0])
    a, b = (load_file(tmp_path / name / "model.safetensors") for name in ("a", "b"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    mtp = f"model.layers.{config['num_hidden_layers']}."
    assert {mtp + n for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight")} <= a.keys()
    model = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "a", dtype=torch.float32)
    assert model.config.kv_lora_rank == 512 and model.config.num_nextn_predict_layers == 1


def test_task_weights_choose_the_mix() -> None:
    from scripts.train_tiny import ASSISTANT, USER, Encoder, TrainingData, build_tokenizer

    tokenizer = build_tokenizer()
    data = TrainingData(Encoder(tokenizer), seed=0, task_weights=(0, 0, 0, 0, 1, 0))
    prompts = []
    for _ in range(20):
        ids, _ = data.short_conversation()
        text = tokenizer.decode(ids, skip_special_tokens=False)
        prompts += [turn.split(ASSISTANT)[0] for turn in text.split(USER)[1:]]
    assert len(prompts) >= 20 and all(p.startswith("Sort the digits: ") for p in prompts), prompts
    for bad in ((1, 1), (0, 0, 0, 0, 0, 0), (1, 1, 1, 1, 1, -1)):
        with pytest.raises(ValueError, match="task weights"):
            TrainingData(Encoder(tokenizer), seed=0, task_weights=bad)


def test_wide_multiplication_share() -> None:
    """--wide-mul-share draws that fraction of the products with a 3-digit operand (training only);
    the 2-digit ones still skip the held-out pairs."""
    from dsinfer.evals.tasks import held_out_keys
    from scripts.train_tiny import Encoder, TrainingData, build_tokenizer

    encoder = Encoder(build_tokenizer())

    def widths(share: float) -> list[int]:
        data = TrainingData(encoder, seed=0, wide_mul_share=share)
        questions = [data.question("mul") for _ in range(200)]
        assert not {q.key for q in questions if len(q.key.split(":")[2]) == 2} & held_out_keys()
        for q in questions:
            a, b = q.prompt.removeprefix("What is ").removesuffix("?").split(" * ")
            assert int(q.answer) == int(a) * int(b)
        return [len(q.key.split(":")[2]) for q in questions]

    assert set(widths(0.0)) == {2}
    assert set(widths(1.0)) == {3}
    assert 60 < widths(0.5).count(3) < 140
    with pytest.raises(ValueError, match="wide_mul_share"):
        TrainingData(encoder, seed=0, wide_mul_share=1.5)
