"""An engine-level pool of rank processes for a benchmark (benchmarks/eplb_stall.py, overlap.py):
the built-in random preset's model grown to a benchmark's sizes, random prompts, the rank
children started from the benchmark's own script (``SCRIPT --rank-child SPEC_JSON``), waited for
within a bound and killed on every exit path, and their JSON results.

In the child, ``join_pool`` joins the gloo group the parent's specs name (one torch thread, the
loader's progress bars off, dying with the parent); a rendezvous port another process took
between the parent choosing and the child binding it ends the child with ``PORT_TAKEN``, and
``run_pool`` starts the pool again on a new port.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from dsinfer.base.processes import die_with_parent, free_port

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
PORT_TAKEN = 75  # a rank's exit status when the rendezvous port was in use
ONE_THREAD = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "NUMBA_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
}


class PortTaken(RuntimeError):
    pass


def exit_on_sigterm() -> None:
    """In the parent: SIGTERM raises SystemExit, so every ``with RankChildren()`` kills its ranks."""

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


class RankChildren:
    """The rank processes of one pool run; leaving the ``with`` block kills those still running."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd)
        self.procs.append(proc)
        return proc

    def __enter__(self) -> RankChildren:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)


# The model and the work ----------------------------------------------------------------------------
def grown_preset(overrides: dict[str, Any], dest: Path) -> tuple[Path, dict[str, Any]]:
    """The built-in random preset's config.json with ``overrides`` (and its tokenizer files) in
    ``dest``: a model to load with ``load_format="dummy"``. -> (dest, the config)."""
    from dsinfer.base.presets import RANDOM_MODEL, resolve_model

    preset, _ = resolve_model(RANDOM_MODEL)
    config = {**json.loads((preset / "config.json").read_text()), **overrides}
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    for file in TOKENIZER_FILES:
        if (preset / file).is_file():
            shutil.copy(preset / file, dest / file)
    return dest, config


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` random token ids in [2, 4000) (neither BOS nor EOS)."""
    rng = random.Random(seed)
    return [[rng.randrange(2, 4000) for _ in range(length)] for _ in range(count)]


# The parent --------------------------------------------------------------------------------------
def run_pool(
    script: Path,
    make_specs: Callable[[str], list[dict[str, Any]]],
    label: str,
    timeout: float,
    attempts: int = 3,
) -> list[dict[str, Any]]:
    """One pool run: a rank child of ``script`` per spec of ``make_specs(init address)``, each
    spec naming where the child writes its result (``"out"``); -> those results, rank by rank.
    Raises when a rank fails or the pool takes longer than ``timeout`` s; a taken rendezvous port
    costs a retry on a new one (``attempts`` in all)."""
    for attempt in range(attempts):
        try:
            return _run_pool_once(script, make_specs(f"tcp://127.0.0.1:{free_port()}"), label, timeout)
        except PortTaken:
            print(f"   {label}: rendezvous port taken, retrying ({attempt + 1})", flush=True)
    raise RuntimeError(f"{label}: rendezvous failed {attempts} times")


def _run_pool_once(
    script: Path, specs: list[dict[str, Any]], label: str, timeout: float
) -> list[dict[str, Any]]:
    env = {**os.environ, **ONE_THREAD}
    outs = [Path(spec["out"]) for spec in specs]
    deadline = time.monotonic() + timeout
    with RankChildren() as children:
        for spec, out in zip(specs, outs, strict=True):
            out.unlink(missing_ok=True)
            children.start([sys.executable, str(script), "--rank-child", json.dumps(spec)], env, REPO)
        pending = list(children.procs)
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{label}: pool did not finish within {timeout} s")
            for p in list(pending):
                rc = p.poll()
                if rc is None:
                    continue
                pending.remove(p)
                if rc == PORT_TAKEN:
                    raise PortTaken(label)
                if rc != 0:
                    raise RuntimeError(f"{label}: a rank exited with status {rc}")
            time.sleep(0.2)
    return [json.loads(o.read_text()) for o in outs]


# The child ---------------------------------------------------------------------------------------
def join_pool(spec: dict[str, Any], timeout: float = 300.0) -> bool:
    """In a rank child: die with the parent, one torch thread, no loader progress bars, then join
    the gloo group of ``spec`` ("init", "rank", "world"). False when the rendezvous port was
    taken (exit with ``PORT_TAKEN``: the parent retries)."""
    die_with_parent()
    import torch
    import torch.distributed as dist

    import dsinfer.model.loader as loader

    bar = loader.tqdm  # the loader's progress bars, per rank, would bury the progress lines
    loader.tqdm = lambda *a, **k: bar(*a, **{**k, "disable": True})
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=spec["init"],
            rank=spec["rank"],
            world_size=spec["world"],
            timeout=datetime.timedelta(seconds=timeout),
        )
    except dist.DistNetworkError as e:
        print(
            f"    [{spec.get('label', '')} rank {spec['rank']}] rendezvous failed: {e}",
            file=sys.stderr,
            flush=True,
        )
        return False
    return True
