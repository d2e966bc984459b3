"""The built-in model's task family and ``dsinfer eval``: a fixed held-out set whose lookup contexts
have the promised lengths, exact-match and form scoring, the command's report and its errors."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from dsinfer.base.presets import DEFAULT_MODEL, resolve_model
from dsinfer.base.tokenizer import Tokenizer
from dsinfer.evals.tasks import (
    TASKS,
    Question,
    final_answer,
    held_out,
    held_out_keys,
    long_multiplication,
    make_question,
    score,
    well_formed,
)


def test_held_out_set_is_fixed_and_distinct() -> None:
    assert held_out("add")[0] == held_out("add")[0]
    for task in TASKS:
        keys = [q.key for q in held_out(task)]
        assert len(set(keys)) == len(keys) == 200
    # the training stream (another seed) meets held-out keys and must skip them: they exist
    rng = random.Random(1)
    drawn = {make_question("mul", rng).key for _ in range(3000)}
    assert drawn & held_out_keys()


def test_lookup_context_lengths() -> None:
    tokenizer = Tokenizer.from_dir(resolve_model(DEFAULT_MODEL)[0])
    for task, low, high in (("lookup", 256, 560), ("lookup_1k", 950, 1150)):
        lengths = [len(tokenizer.encode(q.prompt, add_special_tokens=False)) for q in held_out(task)[:20]]
        assert low <= min(lengths) and max(lengths) <= high, (task, lengths)


def test_score_and_form() -> None:
    q = Question("sort", "Sort the digits: 3 1 2", "1 2 3", "sort:312")
    assert score(q, " 1 2 3\n") and not score(q, "1 2 4")
    assert well_formed(q, "1 2 4") and not well_formed(q, "1 2") and not well_formed(q, "123")
    r = Question("reverse", "Reverse the word: abc", "cba", "reverse:abc")
    assert well_formed(r, "cbb") and not well_formed(r, "cb") and not well_formed(r, "c b")
    a = Question("sub", "What is 3 - 5?", "-2", "sub:3:5")
    assert well_formed(a, "-7") and not well_formed(a, "x")


def test_multiplication_thinks_by_place() -> None:
    """The steps are right for every product of the task (either order) and for wider operands."""
    assert long_multiplication(7, 38) == "7 * 30 = 210\n7 * 8 = 56\n210 + 56 = 266"
    assert long_multiplication(38, 7) == "30 * 7 = 210\n8 * 7 = 56\n210 + 56 = 266"
    assert long_multiplication(3, 405).splitlines()[-1] == "1200 + 0 + 15 = 1215"
    for a in range(10):
        for b in range(10, 100):
            *steps, total = long_multiplication(a, b).splitlines()
            factors = [line.split(" = ")[0].split(" * ") for line in steps]
            products = [int(x) * int(y) for x, y in factors]
            assert all(int(x) == a for x, _ in factors) and sum(int(y) for _, y in factors) == b
            assert [int(line.split(" = ")[1]) for line in steps] == products
            assert total == " + ".join(map(str, products)) + f" = {a * b}"
    q = held_out("mul")[0]
    assert q.reply == f"<think>{q.reasoning}</think>{q.answer}" and q.reasoning


def test_score_reads_the_answer_after_thinking() -> None:
    q = Question("mul", "What is 7 * 38?", "266", "mul:7:38", long_multiplication(7, 38))
    assert score(q, q.reply) and score(q, " 266") and well_formed(q, "<think>x</think>265")
    assert not score(q, "<think>7 * 30 = 210\n7 * 8 = 56\n210 + 56 = 266")  # cut off while thinking
    assert final_answer("<think>a</think> 12 ") == "12" and final_answer("<think>266") == ""


def _eval(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dsinfer.cli.main", "eval", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_eval_command_offline(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    run = _eval("--tasks", "add,sort", "--limit", "2", "--speculative-mtp", "--json", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    assert "| add |" in run.stdout and "| sort |" in run.stdout and "MTP:" in run.stdout
    report = json.loads(out.read_text())
    assert [t["task"] for t in report["tasks"]] == ["add", "sort"]
    assert all(t["total"] == 2 for t in report["tasks"]) and "acceptance_rate" in report["mtp"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--tasks", "add,divide"), "unknown task(s) divide"),
        (("--limit", "0"), "--limit must be between 1 and 200"),
        (("--endpoint", "http://127.0.0.1:9/v1"), "http://127.0.0.1:9/v1"),
    ],
)
def test_eval_command_errors(args: tuple[str, ...], message: str) -> None:
    run = _eval(*args)
    assert run.returncode == 2 and message in run.stderr, run.stderr[-2000:]
