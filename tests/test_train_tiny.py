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

pytestmark = pytest.mark.system

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "train_tiny.py"
# One step of each phase (copy sequences, table conversations, the task mix) with the recipe's two
# threads. Without the script's deterministic kernels, two such runs differed in 2 of 3 tries here.
SHORT_RUN = [
    *("--steps", "3", "--seed", "3", "--threads", "2", "--warmup", "1", "--induction-steps", "1"),
    *("--table-steps", "1", "--short-rows", "8", "--lookup-rows", "1", "--lookup-length", "640"),
    *("--log-every", "1", "--eval-every", "3", "--eval-size", "1"),
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
    assert progress[0] == progress[1] and any(line.startswith("eval step 3") for line in progress[0])
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
    data = TrainingData(Encoder(tokenizer), seed=0, task_weights=(0, 0, 0, 0, 1, 0, 0))
    prompts = []
    for _ in range(20):
        ids, _ = data.short_conversation()
        text = tokenizer.decode(ids, skip_special_tokens=False)
        prompts += [turn.split(ASSISTANT)[0] for turn in text.split(USER)[1:]]
    assert len(prompts) >= 20 and all(p.startswith("Sort the digits: ") for p in prompts), prompts
    for bad in ((1, 1), (0, 0, 0, 0, 0, 0, 0), (1, 1, 1, 1, 1, 1, -1)):
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


def test_thinking_is_learnt_in_the_last_turn_and_dropped_from_history() -> None:
    """A multiplication's reply thinks; as a history turn it is rendered as the chat template
    renders it (the answer only) and left out of the loss."""
    from dsinfer.base.presets import DEFAULT_MODEL, resolve_model
    from dsinfer.base.tokenizer import Tokenizer
    from dsinfer.evals.tasks import held_out
    from scripts.train_tiny import Encoder, TrainingData, build_tokenizer

    encoder = Encoder(build_tokenizer())
    mul, add = held_out("mul")[0], held_out("add")[0]
    think = encoder.tokenizer.token_to_id("<think>")
    ids, mask = encoder.conversation([(add.prompt, add.reply), (mul.prompt, mul.reply)])
    assert think in ids and mask[ids.index(think)]
    ids, mask = encoder.conversation([(mul.prompt, mul.reply), (add.prompt, add.reply)])
    assert think not in ids
    second = ids.index(encoder.user, 2)  # the second turn
    assert not any(mask[:second]) and sum(mask) == len(encoder.text(add.answer)) + 1
    lines = TrainingData(encoder, seed=0).repeat_lines()  # a reply ending in a newline, no thinking
    _, lines_mask = encoder.conversation([(lines.prompt, lines.reply), (add.prompt, add.reply)])
    assert sum(lines_mask) == len(encoder.text(lines.reply)) + len(encoder.text(add.answer)) + 2
    served = Tokenizer.from_dir(resolve_model(DEFAULT_MODEL)[0])
    history = [*mul.messages(), {"role": "assistant", "content": mul.reply}, *add.messages()]
    prompt = served.apply_chat_template(history, add_generation_prompt=True)
    assert served.encode(prompt, add_special_tokens=False) == ids[: ids.index(encoder.assistant, second) + 1]


def test_copy_sequences_repeat_a_random_run() -> None:
    """A copy sequence is bos, a run, the same run again; the loss is on the second run but its
    first token (nothing tells where the repeat starts)."""
    from scripts.train_tiny import COPY_RUN, Encoder, TrainingData, build_tokenizer

    encoder = Encoder(build_tokenizer())
    data = TrainingData(encoder, seed=0)
    lengths = set()
    for _ in range(50):
        ids, mask = data.copy_sequence()
        run = (len(ids) - 1) // 2
        assert len(ids) == len(mask) == 2 * run + 1 and ids[0] == encoder.bos
        assert ids[1 : run + 1] == ids[run + 1 :]
        assert mask == [False] * (run + 2) + [True] * (run - 1)
        text = encoder.tokenizer.decode(ids[1 : run + 1])
        assert text.isalnum() and text.lower() == text
        lengths.add(len(text))
    assert COPY_RUN[0] <= min(lengths) < max(lengths) <= COPY_RUN[1]


def test_repeat_lines_and_table_conversations() -> None:
    """A "lines" reply holds the table's lines, each once, in another order; a table conversation
    is such a turn or lookups whose replies are the asked keys' values."""
    from scripts.train_tiny import ASSISTANT, EOS, USER, Encoder, TrainingData, build_tokenizer

    tokenizer = build_tokenizer()
    data = TrainingData(Encoder(tokenizer), seed=0)
    reordered = 0
    for _ in range(50):
        q = data.repeat_lines()
        table, instruction = q.prompt.rsplit("\n", 1)
        assert instruction == "Repeat the lines."
        assert sorted(q.answer.splitlines()) == sorted(table.splitlines())
        reordered += q.answer.splitlines() != table.splitlines()
    assert reordered > 30
    kinds = set()
    for _ in range(50):
        ids, mask = data.table_conversation()
        text = tokenizer.decode(ids, skip_special_tokens=False)
        turns = [turn.split(ASSISTANT) for turn in text.split(USER)[1:]]
        table = dict(line.split(": ") for line in turns[0][0].splitlines()[:-1])
        for prompt, reply in turns:
            reply = reply.removesuffix(EOS)
            if prompt.endswith("Repeat the lines."):
                kinds.add("lines")
                assert dict(line.split(": ") for line in reply.splitlines()) == table
            else:
                kinds.add("lookup")
                assert reply == table[prompt.removesuffix("?").rsplit(" ", 1)[1]]
        replies = tokenizer.decode(
            [t for t, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False
        )
        assert replies == "".join(reply for _, reply in turns)
    assert kinds == {"lines", "lookup"}


def test_lookup_rows_bound_the_table() -> None:
    """A lookup row holds one conversation whose table has as many lines as fit its most tokens
    with one question (up to 111); rows are padded to the longest, the padding out of the loss."""
    from scripts.train_tiny import Encoder, TrainingData, build_tokenizer

    encoder = Encoder(build_tokenizer())
    data = TrainingData(encoder, seed=0)
    for length in (120, 640):
        assert all(len(data.lookup_conversation(length)[0]) <= length for _ in range(100))
    with pytest.raises(ValueError, match="hold no table"):
        data.lookup_conversation(50)
    lines = [encoder.tokenizer.decode(data.lookup_conversation(1280)[0]).count("\n") for _ in range(200)]
    assert min(lines) < 20 and 100 <= max(lines) <= 111
    batch = data.lookup_rows(3, 1280)
    assert batch.ids.shape[0] == 3 and batch.ids.shape[1] <= 1280
    lengths = (batch.ids != encoder.eos).sum(dim=1) + batch.reply.logical_and(batch.ids == encoder.eos).sum(
        dim=1
    )
    assert int(lengths.max()) == batch.ids.shape[1]
    assert (batch.conversation == 0).all()
