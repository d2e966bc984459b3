"""Fuzz the gateway's served OpenAPI schema with schemathesis: no request may get a 5xx.

Starts ``dsinfer serve`` (the all-in-one PD server, or ``--colocated``) on the built-in tiny model
with dummy weights, then runs ``schemathesis run <server>/openapi.json --checks
not_a_server_error`` with ``--max-examples`` cases per operation (every route: the generation
endpoints, /v1/responses, /v1/messages, /tokenize, /detokenize, /v1/embeddings, /v1/models...),
authenticated with the server's API key. The context length is kept short (``--max-model-len``)
so that a generated ``max_tokens`` never makes a case slow. Writes schemathesis' own output and a
summary (cases, failures, command, machine, load, duration) to ``--out``.

    python benchmarks/api_fuzz.py --max-examples 100 --out benchmarks/results/api_fuzz.md

tests/test_api_fuzz.py runs the fuzzing phase with a few cases per operation.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from harness.results import run_tool
from harness.server import TINY_DUMMY, serve

API_KEY = "fuzz"
TITLE = "schemathesis over the served OpenAPI schema (not_a_server_error)"


@contextlib.contextmanager
def server(mode: str, log_path: Path, max_model_len: int, timeout: float = 180.0) -> Iterator[str]:
    """``dsinfer serve`` (PD, or ``colocated``) on the tiny model until ready; its URL."""
    args = [
        *TINY_DUMMY,
        *("--kv-cache-memory", "32MiB"),
        *("--max-model-len", str(max_model_len), "--max-n", "4", "--api-key", API_KEY),
        *(["--colocated"] if mode == "colocated" else []),
    ]
    with serve(args, log_path.parent, name=log_path.stem, startup_timeout=timeout, stop_grace=30.0) as s:
        yield s.base_url


def fuzz(url: str, max_examples: int, seed: int, timeout: float, phases: str) -> tuple[int, str]:
    """-> (schemathesis' exit code, its output)."""
    command = [
        *(sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json"),
        *("--checks", "not_a_server_error", "--max-examples", str(max_examples), "--seed", str(seed)),
        *("--header", f"Authorization: Bearer {API_KEY}", "--workers", "1", "--no-color"),
        *("--request-timeout", "120", "--suppress-health-check", "all", "--phases", phases),
    ]
    with tempfile.TemporaryDirectory() as scratch:  # schemathesis keeps a cache in its working directory
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, check=False, cwd=scratch
        )
    return done.returncode, done.stdout + done.stderr


def count_cases(output: str) -> int:
    """The number of test cases schemathesis reports as generated."""
    found = re.search(r"Test cases:\s*(\d+) generated", output)
    return int(found.group(1)) if found else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("pd", "colocated"), default="pd")
    parser.add_argument("--max-examples", type=int, default=100, help="cases per operation")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=64)
    parser.add_argument("--phases", default="examples,coverage,fuzzing,stateful")
    parser.add_argument("--timeout", type=float, default=3000.0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/api_fuzz.md"))
    parser.add_argument("--log", type=Path, default=Path("/tmp/api_fuzz_server.log"))
    args = parser.parse_args()

    def fuzz_served() -> tuple[int, str]:
        with server(args.mode, args.log, args.max_model_len) as url:
            return fuzz(url, args.max_examples, args.seed, args.timeout, args.phases)

    done = run_tool(fuzz_served)
    cases = count_cases(done.output)
    facts = [
        f"result: exit code {done.code} ({'no failures' if done.code == 0 else 'FAILURES'}), {cases} test cases",
        f"server: dsinfer serve{' --colocated' if args.mode == 'colocated' else ''}, tiny model, dummy "
        f"weights, --max-model-len {args.max_model_len}",
        f"command: python benchmarks/api_fuzz.py --mode {args.mode} --max-examples {args.max_examples} "
        f"--seed {args.seed} --max-model-len {args.max_model_len} --phases {args.phases}",
    ]
    sys.exit(done.write(args.out, TITLE, facts, "schemathesis", f"{cases} cases"))


if __name__ == "__main__":
    main()
