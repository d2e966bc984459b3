"""lm-eval's ``local-completions`` against ``dsinfer serve``: a multiple-choice (loglikelihood)
task and a generate_until task, both from local files, run to completion.

The tasks and their data are written here (``--work``): ``dsinfer_mc``, questions with four
choices scored by the loglikelihood of each continuation (echo + logprobs, max_tokens 1, as
lm-eval asks), and ``dsinfer_gen``, short answers generated until a newline (exact match). The
server runs the built-in tiny model with dummy weights, so the scores are chance: the point is
that every request of both kinds is answered in lm-eval's layout. Output: lm-eval's results
table and a summary, in ``--out``.

    python benchmarks/lm_eval_run.py --out benchmarks/results/lm_eval.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from harness.provenance import REPO
from harness.results import run_tool
from harness.server import TINY_DUMMY, serve

TOKENIZER = REPO / "configs" / "models" / "tiny"
MODEL = "dsinfer-tiny"
API_KEY = "lm-eval"
CHANCE = "the scores are chance (dummy weights): what counts is that every request completed"
# the tiny model with dummy weights, its context kept short, behind an API key
SERVER_FLAGS = [*TINY_DUMMY, "--kv-cache-memory", "32MiB", "--max-model-len", "512"]
SERVER_FLAGS += ["--api-key", API_KEY, "--served-model-name", MODEL]

MC = [
    ("The capital of France is", [" Paris", " Rome", " Berlin", " Madrid"], 0),
    ("Two plus two equals", [" three", " four", " five", " six"], 1),
    ("Water freezes at zero degrees", [" Kelvin", " Fahrenheit", " Celsius", " Rankine"], 2),
    ("The largest planet is", [" Mars", " Venus", " Earth", " Jupiter"], 3),
    ("A week has seven", [" days", " hours", " months", " years"], 0),
    ("The opposite of hot is", [" warm", " cold", " red", " fast"], 1),
    ("Bees make", [" milk", " silk", " honey", " wool"], 2),
    ("The sun rises in the", [" north", " south", " west", " east"], 3),
]
GEN = [
    ("Q: What is the capital of Italy?\nA:", " Rome"),
    ("Q: How many legs does a spider have?\nA:", " eight"),
    ("Q: What color is the sky?\nA:", " blue"),
    ("Q: What is 3 times 3?\nA:", " nine"),
    ("Q: Which animal says moo?\nA:", " cow"),
]


def write_tasks(work: Path) -> Path:
    """The two tasks' YAML and JSONL files under ``work``; returns the include path."""
    tasks = work / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    mc, gen = tasks / "mc.jsonl", tasks / "gen.jsonl"
    mc.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in MC))
    gen.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in GEN))
    (tasks / "dsinfer_mc.yaml").write_text(
        "task: dsinfer_mc\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {mc}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    (tasks / "dsinfer_gen.yaml").write_text(
        "task: dsinfer_gen\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {gen}\n"
        "test_split: test\noutput_type: generate_until\n"
        'doc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 16\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return tasks


def run_lm_eval(url: str, include: Path, output: Path, timeout: float) -> tuple[int, str]:
    model_args = ",".join(
        [
            f"model={MODEL}",
            f"base_url={url}/v1/completions",
            "tokenizer_backend=huggingface",
            f"tokenizer={TOKENIZER}",
            "num_concurrent=1",
            "max_retries=1",
            "timeout=120",
        ]
    )
    command = [
        *(sys.executable, "-m", "lm_eval", "run", "--model", "local-completions"),
        *("--model_args", model_args, "--tasks", "dsinfer_mc,dsinfer_gen", "--include_path", str(include)),
        *("--output_path", str(output), "--batch_size", "1"),
    ]
    env = {**os.environ, "OPENAI_API_KEY": API_KEY, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False, env=env)
    log = [line for line in done.stderr.splitlines() if "Requesting API" not in line and line.strip()]
    return done.returncode, done.stdout + "\n" + "\n".join(log[-40:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("pd", "colocated"), default="pd")
    parser.add_argument("--work", type=Path, default=Path("/tmp/dsinfer-lm-eval"))
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/lm_eval.md"))
    args = parser.parse_args()
    include = write_tasks(args.work)
    flags = [*SERVER_FLAGS, *(["--colocated"] if args.mode == "colocated" else [])]

    def evaluate() -> tuple[int, str]:
        with serve(flags, args.work, name="server", startup_timeout=180.0) as server:
            return run_lm_eval(server.base_url, include, args.work / "results", args.timeout)

    done = run_tool(evaluate)
    tasks = f"dsinfer_mc ({len(MC)} questions x 4 choices, loglikelihood) and dsinfer_gen ({len(GEN)} questions, generate_until)"
    facts = [
        f"result: lm-eval exit code {done.code}; tasks {tasks}",
        CHANCE,
        f"command: python benchmarks/lm_eval_run.py --mode {args.mode}",
    ]
    sys.exit(
        done.write(args.out, "lm-eval local-completions against dsinfer serve", facts, "lm-eval", "lm-eval")
    )


if __name__ == "__main__":
    main()
