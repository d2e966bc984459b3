"""The built-in model's task family: chat questions with exact answers, drawn from a seeded generator.

Each task writes a user message in free text and the assistant's answer is just the result:

- ``add`` / ``sub``: "What is 123 + 456?" -> "579" (operands of 1 to 3 digits; a difference may be negative)
- ``mul``: "What is 7 * 38?" -> "266" (a 1-digit by a 2-digit number, either order), worked out
  first in a thinking block as DeepSeek-R1 does (``Question.reasoning``: "7 * 30 = 210", "7 * 8 =
  56", "210 + 56 = 266"); the answer after ``</think>`` is still just the result
- ``reverse``: "Reverse the word: planet" -> "tenalp" (1 to 10 lowercase letters)
- ``sort``: "Sort the digits: 3 9 1 2" -> "1 2 3 9" (1 to 8 digits)
- ``lookup``: "key: value" lines, then "What is the value of KEY?" -> the value. ``lookup`` holds
  contexts of 256 to 512 tokens, ``lookup_1k`` of about 1,000 (``context_tokens`` in the built-in
  model's tokenizer: a line "abcd: 123" is 10 tokens).

The held-out set (``held_out``) is fixed by its own seed; training draws from another seed and
skips every question whose ``key`` is held out (operand pairs count in either order), so what is
evaluated was never trained on. Pure Python: the training script, ``dsinfer eval`` and the tests
share it.
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass
from functools import cache

TASKS = ("add", "sub", "mul", "reverse", "sort", "lookup", "lookup_1k")
SHORT_TASKS = ("add", "sub", "mul", "reverse", "sort")
HELD_OUT_SEED = 20_240_917
HELD_OUT_SIZE = 200  # questions per task; evaluations take a prefix of it

# Words the built-in tokenizer keeps whole; keys and words to reverse avoid them.
TOKENIZER_WORDS = ("What", "Reverse", "Sort", " is", " the", " value", " of", " word", " digits")
_RESERVED = {w.strip() for w in TOKENIZER_WORDS}
KEY_LETTERS = 4
LINE_TOKENS = 10  # "abcd: 123\n" in the built-in tokenizer
LOOKUP_LINES = {"lookup": (26, 51), "lookup_1k": (100, 111)}  # [min, max) lines: 256-512 and ~1,000 tokens
TRAIN_LOOKUP_LINES = (2, 112)


THINK, END_THINK = "<think>", "</think>"


@dataclass(frozen=True)
class Question:
    task: str
    prompt: str  # the user message
    answer: str  # the result: the reply's content (after any thinking)
    key: str  # identity for the held-out split
    reasoning: str = ""  # worked steps the reply thinks through before the answer, or none

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.prompt}]

    @property
    def reply(self) -> str:
        """The assistant's whole reply as the model writes it: thinking (if any), then the answer."""
        return f"{THINK}{self.reasoning}{END_THINK}{self.answer}" if self.reasoning else self.answer


def _number(rng: random.Random, max_digits: int) -> int:
    digits = rng.randint(1, max_digits)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def _word(rng: random.Random, low: int, high: int) -> str:
    while True:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(low, high)))
        if word not in _RESERVED:
            return word


def long_multiplication(a: int, b: int) -> str:
    """The steps of ``a * b`` by place (one operand of 1 digit): one line per place of the longer
    operand, "7 * 30 = 210" and "7 * 8 = 56" for 7 * 38, then their sum "210 + 56 = 266". Each
    step is a product of single digits (every one of them occurs in trained questions) or an
    addition (the ``add`` task), so an unseen product composes from trained pieces."""
    wide, digit = (a, b) if a >= 10 else (b, a)
    places = len(str(wide))
    parts = [int(d) * 10 ** (places - 1 - i) for i, d in enumerate(str(wide))]
    steps = [f"{p} * {digit}" if a >= 10 else f"{digit} * {p}" for p in parts]
    lines = [f"{step} = {p * digit}" for step, p in zip(steps, parts, strict=True)]
    return "\n".join([*lines, " + ".join(str(p * digit) for p in parts) + f" = {a * b}"])


def multiplication(rng: random.Random, low: int = 10, high: int = 99) -> Question:
    """A 1-digit number times one in [low, high], either order (the task: 2 digits)."""
    a, b = rng.randint(0, 9), rng.randint(low, high)
    if rng.random() < 0.5:
        a, b = b, a
    key = f"mul:{min(a, b)}:{max(a, b)}"
    return Question("mul", f"What is {a} * {b}?", str(a * b), key, long_multiplication(a, b))


def arithmetic(task: str, rng: random.Random) -> Question:
    if task == "mul":
        return multiplication(rng)
    a, b = _number(rng, 3), _number(rng, 3)
    if task == "add":
        return Question(task, f"What is {a} + {b}?", str(a + b), f"add:{min(a, b)}:{max(a, b)}")
    return Question(task, f"What is {a} - {b}?", str(a - b), f"sub:{a}:{b}")


def reverse(rng: random.Random) -> Question:
    word = _word(rng, 1, 10)
    return Question("reverse", f"Reverse the word: {word}", word[::-1], f"reverse:{word}")


def sort_digits(rng: random.Random) -> Question:
    digits = [str(rng.randint(0, 9)) for _ in range(rng.randint(1, 8))]
    prompt = "Sort the digits: " + " ".join(digits)
    return Question("sort", prompt, " ".join(sorted(digits)), f"sort:{''.join(digits)}")


def lookup_context(rng: random.Random, num_lines: int) -> dict[str, str]:
    """``num_lines`` distinct keys of KEY_LETTERS letters with 3-digit values, in order."""
    table: dict[str, str] = {}
    while len(table) < num_lines:
        table.setdefault(_word(rng, KEY_LETTERS, KEY_LETTERS), str(rng.randint(100, 999)))
    return table


def lookup_question(key: str) -> str:
    return f"What is the value of {key}?"


def render_context(table: dict[str, str]) -> str:
    return "".join(f"{k}: {v}\n" for k, v in table.items())


def lookup(task: str, rng: random.Random) -> Question:
    table = lookup_context(rng, rng.randrange(*LOOKUP_LINES[task]))
    key = rng.choice(list(table))
    prompt = render_context(table) + lookup_question(key)
    return Question(task, prompt, table[key], f"{task}:{prompt}")


def make_question(task: str, rng: random.Random) -> Question:
    if task in ("add", "sub", "mul"):
        return arithmetic(task, rng)
    if task == "reverse":
        return reverse(rng)
    if task == "sort":
        return sort_digits(rng)
    if task in LOOKUP_LINES:
        return lookup(task, rng)
    raise ValueError(f"unknown task {task!r} (choose from {', '.join(TASKS)})")


@cache
def held_out(task: str) -> tuple[Question, ...]:
    """The fixed held-out questions of ``task`` (HELD_OUT_SIZE, distinct keys)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r} (choose from {', '.join(TASKS)})")
    rng = random.Random(f"{HELD_OUT_SEED}:{task}")
    questions: dict[str, Question] = {}
    while len(questions) < HELD_OUT_SIZE:
        q = make_question(task, rng)
        questions.setdefault(q.key, q)
    return tuple(questions.values())


@cache
def held_out_keys() -> frozenset[str]:
    return frozenset(q.key for task in TASKS for q in held_out(task))


def final_answer(reply: str) -> str:
    """The reply's content: what follows ``</think>`` when it thought first (a server with a
    reasoning parser has already split it off), whitespace at the ends dropped."""
    if END_THINK in reply:
        return reply.rpartition(END_THINK)[2].strip()
    return "" if reply.lstrip().startswith(THINK) else reply.strip()  # cut off while thinking: none


def score(question: Question, reply: str) -> bool:
    """Exact match of the reply's content (``final_answer``)."""
    return final_answer(reply) == question.answer


_FORMS = {
    "add": r"-?[0-9]+",
    "sub": r"-?[0-9]+",
    "mul": r"[0-9]+",
    "reverse": r"[a-z]+",
    "sort": r"[0-9]( [0-9])*",
    "lookup": r"[0-9]{3}",
    "lookup_1k": r"[0-9]{3}",
}


def well_formed(question: Question, reply: str) -> bool:
    """The reply has the answer's form, right or wrong: a number for arithmetic, a 3-digit value for
    a lookup, a lowercase word of the same length for reversal, as many spaced digits for sorting."""
    text = final_answer(reply)
    if re.fullmatch(_FORMS[question.task], text) is None:
        return False
    return question.task not in ("reverse", "sort") or len(text) == len(question.answer)
