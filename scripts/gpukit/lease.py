"""``scripts/gpu-lease``: the one command for a GPU machine lent for 15 minutes (docs/gpu.md).

1. Installs the carried wheels and dsinfer (as ``scripts/gpu-check --wheels`` does).
2. Starts the builds of FlashMLA and DeepGEMM from the carried source archives in the background
   (``scripts/build-deepseek-kernels --archives --only``, niced, two processes; DeepGEMM by the
   system's g++, :func:`deepgemm_variants` says why), installing into a folder of their own that
   only phase 2 puts on ``PYTHONPATH``: phase 1 measures dsinfer's own kernels even when a build
   finishes early.
3. Phase 1 (``scripts/gpu-check`` stages): environment, the offline compile check, the GPU tests,
   the kernel figures, the decode step from CUDA graphs with a profile, Nsight Compute launches,
   and last the sweeps, which take what is left of phase 1.
4. Checks each built library: it imports, and DeepGEMM runs one GEMM equal to the reference
   (``dg_selftest.py``) with a JIT compiler that works: nvcc first (``--deepgemm-jit``; on the
   H100 image NVRTC's kernels fail to load, CUDA_ERROR_INVALID_IMAGE), then NVRTC; a crash gets
   one cuda-gdb backtrace. DeepGEMM's check runs beside phase 1 as soon as it is built; the lease
   waits for the builds at most until phase 2's reserve of the deadline begins.
5. Phase 2 with the libraries that passed: their adapters against the torch references, the
   kernel figures with DeepGEMM and FlashMLA beside Triton, the decode step with the library
   backends, then the FP8 parity check.
6. Packs at most 8 files into ``--pack`` (the device tool returns no more): ``lease.md`` (what ran,
   for how long, each phase's table), ``lease.json``, both phases' ``summary.md`` and
   ``results.tgz`` (everything else but checkpoints and build trees). It packs after phase 1 too, so
   a run cut short still returns what it measured.

``--cpu-smoke`` runs the same plumbing on the CPU: no builds (the archives are only checked when
present), the stages in their smoke mode.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .common import ROOT, kill_session, log, run_logged
from .kit import install_wheels
from .stages import BY_NAME

PHASE1 = ("env", "triton-compile", "gpu-tests", "kernels", "v3-graphs", "ncu", "sweeps")
PHASE2 = ("adapters", "kernels", "v3-graphs", "parity")
PHASE2_WITHOUT_LIBRARIES = ("v3-engine", "adapters")
LIBRARIES = {"flash-mla": "flash_mla", "deep-gemm": "deep_gemm"}  # build name -> module
# Stage limits within a lease (the kit's defaults are for a machine held longer): a stage that hangs
# costs its own limit, not the rest of the phase.
BUDGETS = (
    "env=40,triton-compile=60,gpu-tests=90,kernels=150,v3-graphs=160,ncu=70,sweeps=200,adapters=90,parity=150"
)
PACK_LIMIT = 8  # files the device tool brings back
PACK_RESERVE_S = 15.0
BUILD_JOBS = {"flash-mla": 0.9, "deep-gemm": 0.1}  # shares of the CPUs (MAX_JOBS): DeepGEMM is one file


@dataclass
class Build:
    name: str
    log: Path
    module: str = ""
    env: dict[str, str] = field(default_factory=dict)  # what this variant's build sets (compiler, link)
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    seconds: float | None = None
    code: int | None = None
    note: str = ""
    usable: str | None = None  # "" once it imports (and DeepGEMM's self-test passed), else why not

    def poll(self) -> bool:
        """True once finished (or never started)."""
        if self.process is None:
            return True
        if self.code is None and self.process.poll() is not None:
            self.code, self.seconds = self.process.returncode, round(time.monotonic() - self.started, 1)
            log(f"lease: {self.name} build exited {self.code} after {self.seconds:.0f} s")
        return self.code is not None

    def last_line(self) -> str:
        lines = self.log.read_text(errors="replace").strip().splitlines() if self.log.is_file() else []
        return lines[-1][-160:] if lines else ""


@dataclass
class Lease:
    args: argparse.Namespace
    start: float = field(default_factory=time.monotonic)
    steps: list[dict[str, Any]] = field(default_factory=list)
    builds: list[Build] = field(default_factory=list)
    deepgemm_jit: str | None = None  # the way DeepGEMM's self-test passed
    deepgemm_env: dict[str, str] = field(default_factory=dict)  # what phase 2 sets for it
    backtraced: bool = False  # a crash got its cuda-gdb backtrace (one per lease)

    def left(self) -> float:
        return self.args.deadline_s - (time.monotonic() - self.start)

    def step(self, name: str, seconds: float, **info: Any) -> None:
        self.steps.append(
            {
                "step": name,
                "at_s": round(time.monotonic() - self.start, 1),
                "seconds": round(seconds, 1),
                **info,
            }
        )
        log(f"lease: {name} done in {seconds:.0f} s ({self.left():.0f} s left)")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/gpu-lease", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="working folder (stage results, build logs)")
    p.add_argument("--pack", type=Path, required=True, help="where the <= 8 packed files go ($OUT)")
    p.add_argument("--wheels", type=Path, default=None, help="carried wheels (scripts/gpu-wheels)")
    p.add_argument(
        "--sources", type=Path, default=None, help="carried archives (scripts/pack-deepseek-sources)"
    )
    p.add_argument("--deadline-s", type=float, default=560.0, help="the whole run (default 560)")
    p.add_argument("--phase2-reserve-s", type=float, default=230.0, help="kept for phase 2 (default 230)")
    p.add_argument("--phase1", default=",".join(PHASE1), help=f"phase 1 stages (default {','.join(PHASE1)})")
    p.add_argument(
        "--phase2",
        default=",".join(PHASE2),
        help=f"phase 2 stages with a library (default {','.join(PHASE2)})",
    )
    p.add_argument(
        "--budget-s",
        default=BUDGETS,
        help=f"stage time limits, as scripts/gpu-check takes them (default {BUDGETS})",
    )
    p.add_argument("--deepgemm-jit", choices=("nvrtc", "nvcc"), default="nvcc")
    p.add_argument(
        "--builds",
        default=None,
        help="the library builds to run, by name (default all: flash-mla, deep-gemm, ...)",
    )
    p.add_argument("--cpu-smoke", action="store_true", help="the plumbing on CPU: no builds, smoke stages")
    args = p.parse_args(argv)
    for option in ("phase1", "phase2"):
        names = [s.strip() for s in getattr(args, option).split(",") if s.strip()]
        unknown = [n for n in names if n not in BY_NAME]
        if unknown:
            p.error(f"--{option} names unknown stage {unknown[0]!r}; stages: {','.join(BY_NAME)}")
        setattr(args, option, names)
    return args


def deepgemm_variants() -> list[tuple[str, dict[str, str]]]:
    """DeepGEMM's build: by the system's g++ where there is one. The image's ``/opt/gcc/bin/g++``
    (a wrapper of GCC 13.3) links libstdc++ statically: its ``_C`` defined 4,901 ``std::`` symbols
    and did not need libstdc++.so.6, and every first call crashed in ``std::regex`` on a locale
    facet of the wrong type (H100, 2026-11-27 and -28); built by /usr/bin/g++ (the same GCC) it
    runs (2026-11-28). build-deepseek-kernels refuses a DeepGEMM that carries its own libstdc++."""
    if not Path("/usr/bin/g++").exists():
        return [("deep-gemm", {})]
    link = "/usr/bin/g++ -shared -Wl,-O1 -Wl,-Bsymbolic-functions"
    return [
        ("deep-gemm", {"CC": "/usr/bin/gcc", "CXX": "/usr/bin/g++", "LDSHARED": link, "LDCXXSHARED": link})
    ]


def start_builds(lease: Lease, libdir: Path) -> None:
    """The library builds in the background, each in its own session, each installing into its own
    folder under ``libdir`` (so that phase 2 can leave out one that builds but does not work)."""
    args = lease.args
    cpus = os.cpu_count() or 2
    plan = [
        ("flash-mla", "flash-mla", {}),
        *((name, "deep-gemm", extra) for name, extra in deepgemm_variants()),
    ]
    wanted = set(args.builds.split(",")) if args.builds else None
    for name, library, extra in plan:
        if wanted is not None and name not in wanted:
            continue
        build = Build(name, args.out / f"build-{name}.log", LIBRARIES[library], extra)
        lease.builds.append(build)
        env = {
            **os.environ,
            **extra,
            "PYTHON": sys.executable,
            "MAX_JOBS": str(max(1, int(cpus * BUILD_JOBS[library]))),
            "PIP_TARGET": str(libdir / name),  # pip install --target: invisible to phase 1
            "PYTHONPATH": os.pathsep.join(filter(None, [str(libdir / name), os.environ.get("PYTHONPATH")])),
        }
        argv = ["nice", "-n", "10", str(ROOT / "scripts" / "build-deepseek-kernels"), "--archives",
                str(args.sources), "--only", library, "--work", str(args.out / "build" / name)]  # fmt: skip
        with build.log.open("wb") as out:
            build.process = subprocess.Popen(
                argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        build.started = time.monotonic()
        log(
            f"lease: {name} build started (MAX_JOBS={env['MAX_JOBS']}; {extra or 'the image defaults'}), log {build.log}"
        )


def check_sources(lease: Lease) -> None:
    """Under --cpu-smoke: the archives' check only (nothing can be built without CUDA)."""
    for name in LIBRARIES:
        lease.builds.append(
            Build(name, lease.args.out / f"build-{name}.log", LIBRARIES[name], note="not built: CPU smoke")
        )
    if lease.args.sources is None or not lease.args.sources.is_dir():
        lease.builds[0].note = lease.builds[1].note = "not built: CPU smoke, no archives here"
        return
    argv = [
        sys.executable,
        str(ROOT / "scripts" / "pack-deepseek-sources"),
        "--check",
        str(lease.args.sources),
    ]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    note = "archives checked" if run.returncode == 0 else f"archive check FAILED: {run.stderr.strip()[-300:]}"
    for build in lease.builds:
        build.note = f"not built: CPU smoke; {note}"


def wait_for_builds(lease: Lease) -> None:
    until = lease.args.deadline_s - lease.args.phase2_reserve_s
    last_report = 0.0
    while not all(b.poll() for b in lease.builds) and time.monotonic() - lease.start < until:
        if time.monotonic() - last_report > 30:
            last_report = time.monotonic()
            for b in lease.builds:
                if b.code is None and b.process is not None:
                    log(f"lease: {b.name} building ({time.monotonic() - b.started:.0f} s): {b.last_line()}")
        time.sleep(2)
    for b in lease.builds:
        if not b.poll():
            b.note = f"still building after {time.monotonic() - b.started:.0f} s: given up for phase 2"
            log(f"lease: {b.note} ({b.name})")


def choose_deepgemm_jit(lease: Lease, build: Build, env: dict[str, str]) -> str | None:
    """Run the DeepGEMM self-test under each JIT compiler, ``--deepgemm-jit`` first. The first that
    passes becomes ``lease.deepgemm_jit`` (and ``lease.deepgemm_env``). -> None, or why none did
    (each attempt's log is kept; a first crash also gets a cuda-gdb backtrace)."""
    outcomes = []
    for label in ("nvrtc", "nvcc") if lease.args.deepgemm_jit == "nvrtc" else ("nvcc", "nvrtc"):
        trial = {**env, "DG_JIT_DEBUG": "1"}
        trial.pop("DG_JIT_USE_NVRTC", None)
        if label == "nvrtc":
            trial["DG_JIT_USE_NVRTC"] = "1"
        argv = [sys.executable, "-X", "faulthandler", "-m", "scripts.gpukit.dg_selftest"]
        log_name = f"dg-selftest-{build.name}-{label}"
        code, tail = run_logged(argv, lease.args.out / f"{log_name}.log", 150, trial)
        last = tail.strip().splitlines()[-1][-160:] if tail.strip() else ""
        outcomes.append(f"{label}: exit {code}: {last}")
        log(f"lease: DeepGEMM ({build.name}) self-test {label}: exit {code}")
        debugger = shutil.which("cuda-gdb")
        if code is not None and code < 0 and debugger and not lease.backtraced:  # a signal: where, once
            lease.backtraced = True
            gdb = [debugger, "-batch", "-ex", "run", "-ex", "bt 40", "--args", *argv]
            run_logged(gdb, lease.args.out / f"{log_name}-backtrace.log", 90, trial)
        if code == 0:
            lease.deepgemm_jit, lease.deepgemm_env = (
                f"{build.name} {label}",
                {k: v for k, v in trial.items() if k == "DG_JIT_USE_NVRTC"},
            )
            return None
    return "self-test failed (" + "; ".join(outcomes) + ")"


def check_usable(lease: Lease, build: Build, libdir: Path, env: dict[str, str]) -> None:
    """Import the built library (and run DeepGEMM's self-test): ``build.usable`` becomes "" or why not."""
    env_b = {
        **env,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(libdir / build.name), env.get("PYTHONPATH")])),
    }
    why = importable(build.module, env_b)
    if why is None and build.module == "deep_gemm":
        why = choose_deepgemm_jit(lease, build, env_b)
    build.usable = why or ""
    build.note = "imports and runs" if why is None else f"built, not usable: {why}"
    log(f"lease: {build.name}: {build.note}")


def check_deepgemm_when_built(lease: Lease, libdir: Path, env: dict[str, str]) -> None:
    """Thread: :func:`check_usable` each DeepGEMM build as it finishes (beside phase 1), until one
    passes its self-test."""
    pending = [b for b in lease.builds if b.module == "deep_gemm" and b.process is not None]
    while pending and lease.left() > lease.args.phase2_reserve_s:
        for build in [b for b in pending if b.poll()]:
            pending.remove(build)
            if build.code == 0 and not any(b.usable == "" for b in lease.builds if b.module == "deep_gemm"):
                check_usable(lease, build, libdir, env)
        time.sleep(2)


def importable(module: str, env: dict[str, str]) -> str | None:
    """None when ``module`` imports under ``env``, else the last line of why not."""
    run = subprocess.run(
        [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, env=env, timeout=120
    )
    return None if run.returncode == 0 else (run.stderr.strip().splitlines() or ["?"])[-1][-300:]


def run_phase(
    lease: Lease, name: str, stages: list[str], seconds: float, env: dict[str, str]
) -> dict[str, Any] | None:
    args = lease.args
    out = args.out / name
    argv = [sys.executable, str(ROOT / "scripts" / "gpu-check"), "--out", str(out), "--stages", ",".join(stages),
            "--deadline-s", str(max(seconds, 1.0))]  # fmt: skip
    if args.budget_s:
        argv += ["--budget-s", args.budget_s]
    if args.cpu_smoke:
        argv.append("--cpu-smoke")
    log(f"lease: {name}: {shlex.join(argv[1:])}")
    started = time.monotonic()
    process = subprocess.Popen(argv, cwd=ROOT, env=env, start_new_session=True)
    try:
        process.wait(timeout=seconds + 30)
    except subprocess.TimeoutExpired:
        log(f"lease: {name} overran its {seconds:.0f} s: killed")
    finally:
        kill_session(process)
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    statuses = {r["stage"]: r["status"] for r in summary["stages"]} if summary else {}
    lease.step(name, time.monotonic() - started, stages=statuses, exit=process.returncode)
    return summary


def render(lease: Lease, summaries: dict[str, dict[str, Any] | None]) -> str:
    args = lease.args
    lines = [
        f"# gpu-lease ({'CPU smoke' if args.cpu_smoke else 'GPU'})",
        "",
        f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}; "
        f"`{shlex.join(['scripts/gpu-lease', *sys.argv[1:]])}`",
        "",
        "| step | at s | took s | outcome |",
        "|---|---:|---:|---|",
    ]
    for s in lease.steps:
        outcome = ", ".join(f"{k} {v}" for k, v in s.get("stages", {}).items()) or s.get("note", "")
        lines.append(f"| {s['step']} | {s['at_s']:.0f} | {s['seconds']:.0f} | {outcome} |")
    lines += ["", "| library build | exit | s | note / last log line |", "|---|---|---:|---|"]
    for b in lease.builds:
        seconds = "-" if b.seconds is None else f"{b.seconds:.0f}"
        lines.append(
            f"| {b.name} | {b.code if b.code is not None else '-'} | {seconds} | {b.note or b.last_line()} |"
        )
    for name, summary in summaries.items():
        path = args.out / name / "summary.md"
        if summary is not None and path.is_file():
            text = path.read_text().splitlines()
            table = next((i for i, line in enumerate(text) if line.startswith("| stage ")), 0)
            lines += ["", f"## {name}", "", *(line.replace("## ", "### ", 1) for line in text[table:])]
    return "\n".join(lines) + "\n"


def pack(lease: Lease, summaries: dict[str, dict[str, Any] | None]) -> list[Path]:
    """The <= PACK_LIMIT files of ``--pack``; rewritten whole each time."""
    args = lease.args
    args.pack.mkdir(parents=True, exist_ok=True)
    (args.pack / "lease.md").write_text(render(lease, summaries))
    meta = {"deepgemm_jit": lease.deepgemm_jit, "steps": lease.steps, "builds": [{"name": b.name, "exit": b.code, "seconds": b.seconds, "note": b.note}
                                               for b in lease.builds]}  # fmt: skip
    (args.pack / "lease.json").write_text(json.dumps(meta, indent=1) + "\n")
    for name in summaries:
        if (args.out / name / "summary.md").is_file():
            shutil.copy(args.out / name / "summary.md", args.pack / f"{name}_summary.md")
    skip = {"build", "libs", "dg-cache"}
    with tarfile.open(args.pack / "results.tgz", "w:gz") as tar:
        for path in sorted(args.out.iterdir()):
            if path.name not in skip:
                tar.add(
                    path,
                    arcname=f"lease/{path.name}",
                    filter=lambda t: None if t.name.endswith(".safetensors") else t,
                )
    files = sorted(p for p in args.pack.iterdir() if p.is_file())
    if len(files) > PACK_LIMIT:
        raise RuntimeError(f"{len(files)} files in {args.pack}: the device tool returns {PACK_LIMIT}")
    return files


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    lease = Lease(args)
    libdir = args.out / "libs"
    summaries: dict[str, dict[str, Any] | None] = {}
    try:
        if args.wheels is not None:
            started = time.monotonic()
            why = install_wheels(args.wheels, args.out / "wheels.log")
            lease.step("wheels", time.monotonic() - started, note=why or "installed")
            if why is not None:
                print(f"gpu-lease: the wheels do not install: {why}", file=sys.stderr)
                return 2
        if args.cpu_smoke:
            check_sources(lease)
        elif args.sources is not None:
            start_builds(lease, libdir)
        env = {**os.environ, "DG_JIT_CACHE_DIR": str(args.out / "dg-cache")}
        # DeepGEMM builds in about 100 s: its self-test runs beside phase 1, not in phase 2's reserve
        watcher = threading.Thread(target=check_deepgemm_when_built, args=(lease, libdir, env), daemon=True)
        watcher.start()
        summaries["phase1"] = run_phase(
            lease, "phase1", args.phase1, lease.left() - args.phase2_reserve_s - PACK_RESERVE_S, env
        )
        pack(lease, summaries)
        started = time.monotonic()
        wait_for_builds(lease)
        watcher.join(timeout=max(lease.left() - args.phase2_reserve_s / 2, 1.0))
        for b in lease.builds:
            if b.code == 0 and b.usable is None and b.module != "deep_gemm":
                check_usable(lease, b, libdir, env)
        env2 = {**env}
        imported = [b.name for b in lease.builds if b.usable == ""]
        if imported:
            paths = [str(libdir / name) for name in imported]
            env2["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
        if any(b.module == "deep_gemm" and b.usable == "" for b in lease.builds):
            env2.update(lease.deepgemm_env)
        lease.step("builds", time.monotonic() - started, note=f"usable: {', '.join(imported) or 'none'}")
        stages = args.phase2 if imported or args.cpu_smoke else list(PHASE2_WITHOUT_LIBRARIES)
        summaries["phase2"] = run_phase(lease, "phase2", stages, lease.left() - PACK_RESERVE_S, env2)
    finally:
        for b in lease.builds:
            if b.process is not None and not b.poll():
                kill_session(b.process)
        files = pack(lease, summaries)
        log(f"lease: packed {len(files)} files into {args.pack}: {', '.join(p.name for p in files)}")
    failed = [r["stage"] for s in summaries.values() if s for r in s["stages"] if r["status"] == "fail"]
    return 1 if failed else 0
