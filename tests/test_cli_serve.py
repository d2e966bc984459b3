"""`dsinfer serve`: --dry-run layouts and memory plans (all-in-one, deployment profiles, --config
with command-line overrides), one-line flag errors, and the all-in-one supervisor driving fake
``dsinfer serve --role ...`` children (a fake CLI module from tmp_path): a gateway that dies after
it listened is restarted, a child failing at start ends the command with its error line (once),
a second Ctrl-C cuts the drain short."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from dsinfer.base.processes import free_port
from dsinfer.cli.main import main
from tests.test_launcher import TIMEOUT, alive, stop_twice, wait_for

REPO = Path(__file__).resolve().parents[1]
PREFILL_PROFILE = REPO / "configs/profiles/deepseek-v3-h800-prefill-ep32.yaml"
DECODE_PROFILE = REPO / "configs/profiles/deepseek-v3-h800-decode-ep144.yaml"


def serve(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["serve", *args])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    code, _, err = serve(capsys, *args)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dsinfer: error: "), err
    return lines[0]


# --dry-run -------------------------------------------------------------------------------------
def test_dry_run_default_all_in_one(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = serve(capsys, "--dry-run")
    assert code == 0, err
    threads = max(1, (os.cpu_count() or 1) // 2)  # the machine's ranks share its cores
    assert "all-in-one" in out
    assert "processes: 1 gateway, 2 pool launchers, 2 ranks" in out
    assert "http://127.0.0.1:8000/v1, control port a free port at start" in out
    assert f"prefill pool 0: 1 rank (EP1/DP1), rank 0, {threads} thread" in out
    assert f"decode pool 0: 1 rank (EP1/DP1), rank 0, {threads} thread" in out
    assert "memory plan: model tiny-chat, float32 on cpu" in out
    assert "16 of 16 routed experts" in out and "pages" in out


def test_dry_run_threads_shared_by_every_rank(capsys: pytest.CaptureFixture[str]) -> None:
    """Prefill and decode ranks compute at once under load: all the machine's ranks share its cores."""
    code, out, err = serve(capsys, "--dry-run", "--decode-pools", "2", "--decode-pool-size", "2")
    assert code == 0, err
    threads = max(1, (os.cpu_count() or 1) // 5)
    assert f"prefill pool 0: 1 rank (EP1/DP1), rank 0, {threads} thread" in out
    assert f"decode pool 1: 2 ranks (EP2/DP2), ranks 0-1, {threads} thread" in out


def test_dry_run_colocated_all_in_one(capsys: pytest.CaptureFixture[str]) -> None:
    args = (
        "--dry-run",
        "--colocated",
        "--decode-pools",
        "2",
        "--decode-pool-size",
        "2",
        "--threads-per-rank",
        "3",
    )
    code, out, err = serve(capsys, *args)
    assert code == 0, err
    assert "prefill" not in out
    assert "colocated pool 1: 2 ranks (EP2/DP2), ranks 0-1, 3 threads per rank" in out
    assert "8 of 16 routed experts" in out


def test_dry_run_prefill_profile(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = serve(capsys, "--config", str(PREFILL_PROFILE), "--dry-run", "--node-rank", "3")
    assert code == 0, err
    assert "prefill pool 0: 32 ranks (EP32/DP32) on 4 nodes, 8 per node" in out
    assert "this node (node-rank 3): launcher + ranks 24-31" in out
    assert "dist-init dsinfer-prefill-0:29500; gateway dsinfer-gateway:8001" in out
    assert "memory plan: model deepseek-v3, bfloat16 on cuda, FP8 weights kept" in out
    assert "9 of 256 routed experts" in out  # 256 + 32 redundant over 32 ranks
    assert "KV cache: 16.0 GiB (--kv-cache-memory) = 3758 pages" in out  # 62 layers (MTP) x 64 x 576 x 2 B


def test_dry_run_decode_profile(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = serve(capsys, "--config", str(DECODE_PROFILE), "--dry-run")
    assert code == 0, err
    assert "decode pool 0: 144 ranks (EP144/DP144) on 18 nodes, 8 per node" in out
    assert "this node (node-rank 0): launcher + ranks 0-7" in out
    assert "2 of 256 routed experts" in out
    assert "KV cache: 26.0 GiB (--kv-cache-memory) = 6107 pages" in out


def test_config_with_underscores_and_command_line_override(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "pool.yaml"
    config.write_text(
        "role: colocated\npool_size: 4\nnnodes: 2\ngateway-addr: '10.0.0.1:9001'\n"
        "dist_init_addr: 'head:29500'\nkv-cache-memory: 64MiB\nthreads-per-rank: 2\nno-prefix-caching: true\n"
    )
    code, out, err = serve(
        capsys, "--config", str(config), "--dry-run", "--pool-size", "8", "--node-rank", "1"
    )
    assert code == 0, err
    assert "colocated pool 0: 8 ranks (EP8/DP8) on 2 nodes, 4 per node" in out
    assert "this node (node-rank 1): launcher + ranks 4-7, 2 threads per rank" in out
    assert "gateway 10.0.0.1:9001" in out and "KV cache: 64.0 MiB" in out


def test_gateway_dry_run(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = serve(capsys, "--role", "gateway", "--port", "9000", "--dry-run")
    assert code == 0, err
    assert "http://127.0.0.1:9000/v1" in out and "127.0.0.1:9001" in out


def test_dry_run_through_the_command() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dsinfer.cli.main", "serve", "--config", str(DECODE_PROFILE), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT * 4,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "EP144" in result.stdout


# Errors ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("content", "needles"),
    [
        ("pool-size: 2\nbogus-flag: 1\n", ["unknown key 'bogus-flag'"]),
        ("pool-size: [\n", ["not valid YAML"]),
        ("pool-size: lots\n", ["{path}", "--pool-size: invalid int value"]),
        ("colocated: 3\n", ["colocated takes true or false"]),
        ("- pool-size\n", ["expected a mapping"]),
    ],
)
def test_config_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, needles: list[str]
) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(content)
    line = one_line_error(capsys, "--config", str(config))
    assert all(needle.format(path=config) in line for needle in needles), line


def test_missing_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "no such config file" in one_line_error(capsys, "--config", str(tmp_path / "missing.yaml"))


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--role", "prefill"), "--role prefill needs --gateway-addr"),
        (("--pool-size", "2"), "--pool-size applies to one pool"),
        (
            ("--role", "decode", "--gateway-addr", "h:1", "--decode-pools", "2"),
            "--decode-pools applies to the all-in-one",
        ),
        (("--role", "gateway", "--nnodes", "2"), "--nnodes applies to a pool"),
        (("--colocated", "--prefill-pools", "2"), "--prefill-pools does not apply with --colocated"),
        (("--decode-pool-size", "0"), "--decode-pool-size must be at least 1"),
        (
            ("--role", "decode", "--gateway-addr", "h:1", "--pool-size", "3", "--nnodes", "2"),
            "not a multiple",
        ),
        (
            ("--role", "decode", "--gateway-addr", "h:1", "--nnodes", "2", "--pool-size", "2"),
            "dist_init_addr",
        ),
        (
            ("--role", "decode", "--gateway-addr", "h:1", "--kv-quarantine", "0"),
            "kv_quarantine must be positive",
        ),
        (("--drain-timeout", "0"), "--drain-timeout must be positive"),
        (("--max-num-seqs", "0"), "max_num_seqs must be at least 1"),
        (("--role", "gateway", "--port", "70000"), "port must be in"),
    ],
)
def test_flag_errors_are_one_line(
    capsys: pytest.CaptureFixture[str], args: tuple[str, ...], needle: str
) -> None:
    assert needle in one_line_error(capsys, "--dry-run", *args)


def test_argparse_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--role", "bogus"])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("dsinfer: error: argument --role: invalid choice"), last


# All-in-one supervision with fake children -----------------------------------------------------
FAKE_CLI = """
import json, os, signal, socket, sys, time
from pathlib import Path

argv = sys.argv[1:]
flags = argv[argv.index("serve") + 1 :]
role = flags[flags.index("--role") + 1]
tag = "gateway" if role == "gateway" else f"{role}.{flags[flags.index('--pool-id') + 1]}"
out = Path(os.environ["FAKE_CLI_DIR"])
with (out / f"{tag}.starts").open("a") as starts:
    starts.write(f"{os.getpid()}\\n")

def on_term(signum, frame):
    (out / f"{tag}.term").write_text("")
    sys.exit(0)

ignore_term = role != "gateway" and os.environ.get("FAKE_CLI_IGNORE_TERM")
signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore_term else on_term)
fail_tag, _, fail = os.environ.get("FAKE_CLI_FAIL", "").partition(":")
if fail_tag == tag:  # at start, as a bad flag or checkpoint would: before the gateway listens
    code, _, message = fail.partition(":")
    print("starting", file=sys.stderr)
    print(f"dsinfer: error: {message}", file=sys.stderr)
    sys.exit(int(code))
if role == "gateway":
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", int(flags[flags.index("--port") + 1])))
    listener.listen()
info = {
    "pid": os.getpid(), "argv": argv, "api_key": os.environ.get("DSINFER_API_KEY"),
    "secret": os.environ.get("DSINFER_CLUSTER_SECRET"),
}
(out / f"{tag}.tmp").write_text(json.dumps(info))
(out / f"{tag}.tmp").rename(out / f"{tag}.json")
die = out / f"die.{tag}"
while not die.exists():
    time.sleep(0.02)
die.unlink()
sys.exit(5)
"""

DRIVER = """
import logging, sys
from dsinfer.cli.main import build_parser
from dsinfer.cli.serve_all_in_one import run_all_in_one
logging.basicConfig(level="INFO", format="%(name)s: %(message)s")
sys.exit(run_all_in_one(build_parser().parse_args(sys.argv[1:]), cli_module="fake_cli"))
"""


class AllInOne:
    def __init__(self, tmp_path: Path, *args: str, **env: str) -> None:
        self.dir = tmp_path / "children"
        self.dir.mkdir()
        (tmp_path / "fake_cli.py").write_text(FAKE_CLI)
        pythonpath = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
        environ = {**os.environ, "PYTHONPATH": pythonpath, "FAKE_CLI_DIR": str(self.dir), **env}
        environ.pop("DSINFER_API_KEY", None)
        port = [] if "--port" in args else ["--port", str(free_port())]
        self.log_path = tmp_path / "all-in-one.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", DRIVER, "serve", *port, *args], env=environ, stderr=log
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_log(self, text: str) -> None:
        wait_for(lambda: text in self.log(), repr(text))

    def starts(self, tag: str) -> int:
        path = self.dir / f"{tag}.starts"
        return len(path.read_text().split()) if path.exists() else 0

    def child(self, tag: str) -> dict[str, Any]:
        path = self.dir / f"{tag}.json"
        wait_for(path.exists, f"the {tag} child")
        return json.loads(path.read_text())

    def children(self) -> list[str]:
        return sorted(p.stem for p in self.dir.glob("*.json"))

    def wait(self) -> tuple[int, str]:
        return self.proc.wait(timeout=TIMEOUT), self.log()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=TIMEOUT)
        for path in self.dir.glob("*.json"):
            pid = json.loads(path.read_text())["pid"]
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def servers(closing: list[AllInOne]) -> list[AllInOne]:
    return closing


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_all_in_one_starts_children_with_flags_and_stops_them(
    tmp_path: Path, servers: list[AllInOne]
) -> None:
    server = AllInOne(
        tmp_path, "--max-num-seqs", "7", "--api-key", "sekrit", "--drain-timeout", "2", "--port", "8123"
    )
    servers.append(server)
    gateway, prefill, decode = server.child("gateway"), server.child("prefill.0"), server.child("decode.0")
    control = flag(gateway["argv"], "--control-port")
    assert flag(gateway["argv"], "--role") == "gateway" and flag(gateway["argv"], "--port") == "8123"
    assert gateway["api_key"] == "sekrit"
    threads = str(max(1, (os.cpu_count() or 1) // 2))
    for child, role in ((prefill, "prefill"), (decode, "decode")):
        argv = child["argv"]
        assert flag(argv, "--role") == role and flag(argv, "--pool-id") == "0"
        assert flag(argv, "--gateway-addr") == f"127.0.0.1:{control}"
        assert flag(argv, "--threads-per-rank") == threads and flag(argv, "--drain-timeout") == "2.0"
        assert "--port" not in argv
    for child in (gateway, prefill, decode):
        assert flag(child["argv"], "--max-num-seqs") == "7" and "sekrit" not in child["argv"]
    assert server.children() == ["decode.0", "gateway", "prefill.0"]

    server.proc.send_signal(signal.SIGTERM)
    code, err = server.wait()
    assert code == 0, err
    assert all((server.dir / f"{tag}.term").exists() for tag in ("gateway", "prefill.0", "decode.0")), err
    assert f"API at http://127.0.0.1:8123/v1; pools register on control port {control}" in err


def test_all_in_one_restarts_a_dead_gateway_and_keeps_the_pools(
    tmp_path: Path, servers: list[AllInOne]
) -> None:
    server = AllInOne(tmp_path, "--colocated", "--decode-pools", "2")
    servers.append(server)
    pools = [server.child(f"colocated.{i}") for i in range(2)]
    first = server.child("gateway")
    secrets = {p["secret"] for p in [*pools, first]}  # one secret per run, for every child
    assert len(secrets) == 1 and len(secrets.pop() or "") >= 32
    assert not any(first["secret"] in " ".join(p["argv"]) for p in [*pools, first])
    server.wait_log("the gateway listens on port")  # it was ready: it is restarted
    (server.dir / "die.gateway").write_text("")
    wait_for(lambda: server.child("gateway")["pid"] != first["pid"], "a new gateway")
    second = server.child("gateway")
    assert second["argv"] == first["argv"] and second["secret"] == first["secret"]
    assert all(alive(p["pid"]) for p in pools) and not list(server.dir.glob("*.term"))
    server.proc.send_signal(signal.SIGTERM)
    code, err = server.wait()
    assert code == 0, err
    assert "the gateway exited with code 5; restart 1/100" in err, err


def test_all_in_one_stops_everything_when_the_gateway_dies_past_max_restarts(
    tmp_path: Path, servers: list[AllInOne]
) -> None:
    server = AllInOne(
        tmp_path, "--colocated", "--decode-pools", "2", "--decode-pool-size", "3", "--max-restarts", "0"
    )
    servers.append(server)
    pools = [server.child(f"colocated.{i}") for i in range(2)]
    assert [flag(p["argv"], "--pool-size") for p in pools] == ["3", "3"]
    server.child("gateway")
    server.wait_log("the gateway listens on port")
    (server.dir / "die.gateway").write_text("")
    code, err = server.wait()
    assert code == 1, err
    assert "dsinfer: error: gateway exited with code 5; stopping everything" in err
    assert server.children() == ["colocated.0", "colocated.1", "gateway"]
    assert all((server.dir / f"colocated.{i}.term").exists() for i in range(2))
    assert not any(alive(p["pid"]) for p in pools)


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("dsinfer: error:")]


@pytest.mark.parametrize(
    ("failing", "code", "message"),
    [
        ("gateway", 3, "--tool-call-parser: no such parser"),
        (
            "decode.0",
            2,
            "decode pool 0: rank 0 exited with code 1 before the pool was up: CheckpointError: x",
        ),
    ],
)
def test_all_in_one_child_failing_at_start_ends_the_command(
    tmp_path: Path, servers: list[AllInOne], failing: str, code: int, message: str
) -> None:
    """A gateway exiting before it listened, or a launcher whose ranks never came up (exit 2), is
    not restarted: the others stop at once, the child's error line is printed once (last) and the
    command exits 2."""
    started = time.monotonic()
    server = AllInOne(tmp_path, "--drain-timeout", "60", FAKE_CLI_FAIL=f"{failing}:{code}:{message}")
    servers.append(server)
    exit_code, err = server.wait()
    assert exit_code == 2, err
    assert time.monotonic() - started < 15, err
    assert error_lines(err) == [f"dsinfer: error: {message}"], err
    assert err.strip().splitlines()[-1] == f"dsinfer: error: {message}"
    assert server.starts(failing) == 1 and "restart" not in err, err
    # a child stopped before it got as far as writing its record (a loaded machine) has no pid to
    # check; the command waited for it before exiting
    started_others = [
        t for t in ("gateway", "prefill.0", "decode.0") if t != failing and t in server.children()
    ]
    assert not any(alive(server.child(tag)["pid"]) for tag in started_others)


def test_all_in_one_second_ctrl_c_stops_at_once(tmp_path: Path, servers: list[AllInOne]) -> None:
    server = AllInOne(tmp_path, "--drain-timeout", "60", FAKE_CLI_IGNORE_TERM="1")
    servers.append(server)
    children = [server.child(tag) for tag in ("gateway", "prefill.0", "decode.0")]
    code, err, seconds = stop_twice(server, "all-in-one: stopping")
    assert code == 0, err
    assert seconds < 10, err
    assert err.count("second stop signal") == 1, err
    assert not any(alive(child["pid"]) for child in children)


# Per-GPU memory plan and --gpu-memory (deployment) ------------------------------------------
@pytest.mark.parametrize(
    ("profile", "slots", "ep"),
    [
        (PREFILL_PROFILE, 9, "DeepEP normal mode: NVLink"),
        (
            DECODE_PROFILE,
            2,
            "DeepEP low-latency RDMA buffer for 128 tokens per rank x 288 expert slots",
        ),
    ],
)
@pytest.mark.parametrize("model", ["deepseek-v3", "deepseek-v3.2"])
def test_dry_run_h800_profiles_fit_80gb(
    capsys: pytest.CaptureFixture[str], profile: Path, slots: int, ep: str, model: str
) -> None:
    """The H800 profiles with V3 and with V3.2, whose pages also hold the FP8 indexer keys and whose
    attention activations hold the indexer's logits."""
    code, out, err = serve(capsys, "--config", str(profile), "--dry-run", "--model", model)
    assert code == 0, err
    assert "per-GPU memory of --gpu-memory 74.5 GiB:" in out  # 80GB = 80e9 bytes
    assert re.search(r"^    total +\d+\.\d GiB: fits, \d+\.\d GiB left$", out, re.MULTILINE), out
    weights = next(line for line in out.splitlines() if line.lstrip().startswith("weights "))
    assert "FP8" in weights and "routed experts" in weights and "attention" in weights
    assert "+ bfloat16" in weights and "embedding + lm_head" in weights
    assert f"{slots} routed slots per MoE layer" in weights
    assert ep in out
    assert "KV transfer         0 B  the KV cache is registered in place" in out
    assert "288 slots" in out and "32 experts replicated" in out
    assert "warning" not in out
    if model == "deepseek-v3.2":
        assert "62 layers x (latent 576 x bfloat16 + indexer 132 x uint8: 1284 B per token)" in out
        assert "the indexer's logits" in out


def test_dry_run_placement_per_node(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = serve(capsys, "--config", str(PREFILL_PROFILE), "--dry-run")
    assert code == 0, err
    nodes = [line for line in out.splitlines() if line.startswith("    node ")]
    assert len(nodes) == 4 and nodes[0].startswith("    node 0 (ranks 0-7): experts ")
    assert "layer 3 of 59 MoE layers shown" in out  # 58 MoE layers + the MTP layer


def test_dry_run_refuses_a_layout_that_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = serve(capsys, "--config", str(DECODE_PROFILE), "--dry-run", "--kv-cache-memory", "48GiB")
    assert code == 2
    assert "DOES NOT FIT" in out  # the plan is printed first
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "dsinfer: error: decode pool (EP144) does not fit: it needs "
    )
    assert "more than --gpu-memory 74.5 GiB; lower --kv-cache-memory to at most 41.9 GiB" in lines[0]
    # EP8 prefill: 36 expert slots per GPU cannot fit even without a KV cache
    line = one_line_error(
        capsys, "--config", str(PREFILL_PROFILE), "--dry-run", "--pool-size", "8", "--nnodes", "1"
    )
    assert "prefill pool (EP8) does not fit" in line and "even without a KV cache" in line


def test_a_pool_that_does_not_fit_is_refused_before_it_starts(capsys: pytest.CaptureFixture[str]) -> None:
    line = one_line_error(capsys, "--config", str(DECODE_PROFILE), "--kv-cache-memory", "48GiB")
    assert "decode pool (EP144) does not fit" in line


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ("--num-redundant-experts", "30"),
            "256 routed + 30 redundant experts = 286 slots cannot be spread evenly",
        ),
        (("--gpu-memory", "lots"), "--gpu-memory: cannot read 'lots' as a size"),
        (("--gpu-memory", "0"), "--gpu-memory must be positive"),
    ],
)
def test_dry_run_plan_errors(capsys: pytest.CaptureFixture[str], args: tuple[str, ...], needle: str) -> None:
    assert needle in one_line_error(capsys, "--config", str(PREFILL_PROFILE), "--dry-run", *args)


def test_gpu_memory_applies_to_pools_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--gpu-memory applies to a pool" in one_line_error(
        capsys, "--role", "gateway", "--gpu-memory", "80GB", "--dry-run"
    )
    assert "--gpu-memory applies to one pool" in one_line_error(capsys, "--gpu-memory", "80GB", "--dry-run")


def test_ep_backend_torch_plans_no_deepep_buffers(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = serve(capsys, "--config", str(DECODE_PROFILE), "--dry-run", "--gpu-memory", "80GB")
    assert code == 0, err
    assert "DeepEP low-latency RDMA buffer" in out
    code, out, err = serve(
        capsys, "--config", str(DECODE_PROFILE), "--dry-run", "--gpu-memory", "80GB", "--ep-backend", "torch"
    )
    assert code == 0, err
    assert "torch all-to-all over NCCL (--ep-backend torch)" in out and "DeepEP" not in out
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--dry-run", "--ep-backend", "nccl"])
    assert exit_info.value.code == 2
    assert "argument --ep-backend: invalid choice: 'nccl'" in capsys.readouterr().err


def test_decode_low_latency_buffer_sized_for_the_decode_step(capsys: pytest.CaptureFixture[str]) -> None:
    """The plan sizes DeepEP's low-latency buffer per token, for the tokens of a decode step per rank
    (--max-num-seqs, doubled with MTP), as the rank builds it; no rows x top-k."""
    code, out, err = serve(
        capsys,
        "--config",
        str(DECODE_PROFILE),
        "--dry-run",
        "--max-num-seqs",
        "128",
        "--kv-cache-memory",
        "20GiB",
    )
    assert code == 0, err
    assert "DeepEP low-latency RDMA buffer for 256 tokens per rank" in out and "warning" not in out


def test_deepep_buffer_estimates_follow_deepep_formulas() -> None:

    from dsinfer.cli import memory_plan

    # low latency, V3 on EP144 with 288 slots, 1024 rows: 2 x (send + receive) of 288 x 1024
    # combine messages (56 x 4 + 7168 x 2 = 14560 bytes) plus signaling, 128-byte aligned
    n = memory_plan.deepep_low_latency_bytes(1024, 7168, 144, 288)
    assert n == ((2 * (2 * 288 * 1024 * 14560 + 2432) // 128) + 1) * 128
    # normal mode on 8 ranks: NVLink only (no RDMA below 9 ranks)
    nvl, rdma = memory_plan.deepep_normal_bytes(8, 7168 * 2) or (0, 0)
    raw = 10 * 8 * (2 * 1 + 3) * 4 + 10 * 8 * 256 * (7168 * 2 + 8 + 128 * 12 + 128 * 4)  # 10 channels
    assert rdma == 0 and nvl == -(-raw // 128) * 128
    assert memory_plan.deepep_normal_bytes(12, 7168 * 2) is None
