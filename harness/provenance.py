"""Where a result comes from: the machine (CPU model, ISA flags, cores, memory, load), the git
commit of the checkout (flagged when dsinfer's sources differ from it), the command line and the
date; and a clean copy of a commit for servers that must run it whatever the checkout holds."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("dsinfer", "kernels", "configs")  # what a server runs: the package, its kernels, presets
ISA_PREFIXES = ("avx512", "amx", "avx2")


# Machine ---------------------------------------------------------------------------------------
def _cpuinfo() -> tuple[str, list[str]]:
    """(model name, the ISA flags dsinfer's CPU kernels care about) from /proc/cpuinfo."""
    model, flags = "?", set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "?":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    return model, sorted(f for f in flags if f.startswith(ISA_PREFIXES))


def _lscpu() -> dict[str, str]:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        return {
            k.strip(): v.strip() for k, v in (line.split(":", 1) for line in out.splitlines() if ":" in line)
        }
    return {}


def _int(text: str | None) -> int | None:
    try:
        return int(text or "")
    except ValueError:
        return None


def machine_info(torch: bool = False) -> dict[str, Any]:
    """The CPU (model, ISA flags, online CPUs, cores per socket, threads per core), memory, kernel
    and Python; ``torch``: its version too (imports it)."""
    model, isa = _cpuinfo()
    lscpu = _lscpu()
    info: dict[str, Any] = {
        "cpu_model": lscpu.get("Model name") or model,
        "cpu_isa": isa,
        "online_cpus": os.cpu_count(),
        "cores_per_socket": _int(lscpu.get("Core(s) per socket")),
        "threads_per_core": _int(lscpu.get("Thread(s) per core")),
        "mem_total_gib": None,
        "kernel": platform.release(),
        "python": platform.python_version(),
    }
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem = Path("/proc/meminfo").read_text().split("\n")[0].split()
        info["mem_total_gib"] = round(int(mem[1]) / (1 << 20), 1)
    if torch:
        with contextlib.suppress(ImportError):
            import torch as torch_module

            info["torch"] = torch_module.__version__
    return info


def parse_cpu_list(cores: str) -> list[int]:
    """``"0-3,8"`` (as ``taskset -c`` takes it) -> [0, 1, 2, 3, 8]."""
    out: list[int] = []
    for part in cores.split(","):
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return out


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded to 0.01 (a shared machine's noise)."""
    return [round(x, 2) for x in os.getloadavg()]


# Commit ----------------------------------------------------------------------------------------
def git(*argv: str, cwd: Path = REPO) -> str:
    """``git ARGV`` in the checkout: its stdout, stripped (raises when git fails)."""
    return subprocess.run(
        ["git", *argv], cwd=cwd, capture_output=True, text=True, timeout=60, check=True
    ).stdout.strip()


def git_state(paths: tuple[str, ...] = SOURCES) -> dict[str, Any]:
    """``{"commit": HEAD or None, "dirty": whether ``paths`` differ from it}``."""
    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--", *paths))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": False}


def git_commit(short: bool = False, paths: tuple[str, ...] = SOURCES) -> str:
    """HEAD (12 characters when ``short``), flagged when ``paths`` hold uncommitted changes;
    "unknown" outside a checkout."""
    state = git_state(paths)
    if state["commit"] is None:
        return "unknown"
    head = state["commit"][:12] if short else state["commit"]
    return f"{head} (uncommitted changes in {', '.join(p + '/' for p in paths)})" if state["dirty"] else head


# Run -------------------------------------------------------------------------------------------
def command_line(python: str | None = None) -> str:
    """This process's command line, as a shell would take it (``python``: how to name the interpreter)."""
    return shlex.join([python or Path(sys.executable).as_posix(), *sys.argv])


def utc_now(seconds: bool = True) -> str:
    """``YYYY-MM-DD HH:MM[:SS] UTC``."""
    return datetime.datetime.now(datetime.timezone.utc).strftime(
        f"%Y-%m-%d %H:%M{':%S' if seconds else ''} UTC"
    )


def provenance(torch: bool = False) -> dict[str, Any]:
    """What every report starts with: date, command, commit, machine and load average."""
    return {
        "date": utc_now(),
        "command": command_line(),
        "commit": git_commit(),
        "machine": machine_info(torch),
        "load_avg_start": list(os.getloadavg()),
    }


def run_machine(torch_threads: int | None = None) -> dict[str, Any]:
    """Where a benchmark's run comes from, taken as it starts (it sets ``load_after`` as it
    ends): the machine, the date, the commit of what it runs, the command, the load."""
    machine = {
        **machine_info(),
        "date": utc_now(),
        "load_before": load_average(),
        "commit": git_commit(short=True, paths=(*SOURCES, "harness")),
        "command": command_line(".venv/bin/python"),
    }
    if torch_threads is not None:
        machine["torch_threads"] = torch_threads
    return machine


# A commit to run -------------------------------------------------------------------------------
def export_commit(rev: str, dest: Path) -> tuple[str, Path]:
    """A clean copy of ``rev`` (``git archive``) in ``dest``, laid out as the editable install maps
    it (``kernels/`` -> ``dsinfer.kernels``, ``configs/models`` -> ``dsinfer.presets``), so that
    servers started with PYTHONPATH=dest run that commit whatever the checkout holds meanwhile.
    ``rev == "worktree"``: a copy of the checkout's files as they are now (tracked, and untracked
    but not ignored), described as HEAD + the sha256 of ``git diff HEAD`` and the untracked files."""
    dest.mkdir(parents=True, exist_ok=True)
    if rev == "worktree":
        head = git("rev-parse", "HEAD")
        files = git("ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0")
        present = [f for f in files if f and (REPO / f).is_file() and f.split("/")[0] in SOURCES]
        for f in present:
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, dest / f)
        diff = subprocess.run(
            ["git", "diff", "HEAD", "--", *SOURCES], cwd=REPO, capture_output=True, check=True
        ).stdout
        untracked = git("ls-files", "--others", "--exclude-standard", "--", *SOURCES)
        sha = (
            f"{head} + uncommitted working tree (git diff HEAD sha256 {hashlib.sha256(diff).hexdigest()[:16]},"
            f" {len(diff.splitlines())} diff lines; untracked: {', '.join(untracked.split()) or 'none'})"
        )
    else:
        sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
        with subprocess.Popen(
            ["git", "archive", "--format=tar", sha], cwd=REPO, stdout=subprocess.PIPE
        ) as arch:
            subprocess.run(["tar", "-x", "-C", str(dest)], stdin=arch.stdout, check=True, timeout=120)
        if arch.returncode != 0:
            raise RuntimeError(f"git archive {sha} failed with {arch.returncode}")
    (dest / "dsinfer" / "kernels").symlink_to(dest / "kernels", target_is_directory=True)
    (dest / "dsinfer" / "presets").symlink_to(dest / "configs" / "models", target_is_directory=True)
    probe = "import dsinfer, dsinfer.kernels, dsinfer.presets as p; print(dsinfer.__file__, p.__file__)"
    seen = subprocess.run(
        [sys.executable, "-c", probe],
        env=source_env(dest),
        cwd=dest,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.split()
    if not all(Path(f).resolve().is_relative_to(dest.resolve()) for f in seen):
        raise RuntimeError(f"the export at {dest} is not what python imports: {seen}")
    return sha, dest


def source_env(source: Path | None, env: dict[str, str] | None = None) -> dict[str, str]:
    """This environment with ``env`` on top, and ``source`` (an ``export_commit``) first on
    PYTHONPATH when given."""
    out = {**os.environ, **(env or {})}
    if source is not None:
        out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(source), out.get("PYTHONPATH")]))
    return out
