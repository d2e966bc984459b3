"""The CPU profile's rendered commands, run here as plain processes, serve requests; and a pool
that leaves by the scaling path (its pods get SIGTERM) drains and deregisters before it stops,
with no request failing.

`helm template` of values-cpu-tiny.yaml gives a gateway Deployment of 2 replicas, 1 prefill pool
(1 rank, 1 pod) and 2 decode pools (LeaderWorkerSet groups of 2 pods, 1 rank each). Each pod
becomes one process started from its container's command and args exactly as rendered, with its
environment made as the kubelet and LWS would make it (downward-API fields, Secret keys, the
cluster secret included, LWS_* variables) and $(VAR) references expanded. Only ports and names
are rewritten, because this machine has one network namespace and no cluster DNS:

- gateway replica i's pod IP ($(POD_IP), its `--host`) is `127.0.0.<i+1>` (loopback addresses);
- gateway `--port` and `--control-port` -> free ports (8000/8001 may be taken here), the same for
  every replica, as in a cluster;
- pools `--gateway-addr <headless service>.<namespace>.svc:8001` (one address per replica) ->
  `127.0.0.1:<control port>,127.0.0.2:<control port>`;
- pools `--dist-init-addr $(LWS_LEADER_ADDRESS):29500` -> `127.0.0.1:<a free port per group>`
  (LWS_LEADER_ADDRESS stands for 127.0.0.1; in a cluster every group's leader has its own IP);
- the pod IP ($(POD_IP), `--worker-host`) is 127.0.0.1.

The `dsinfer` entry point runs as this interpreter's `python -m dsinfer.cli.main` (the same
console script). The pools' exec probes run the chart's files/pool_probe.py (what the probe
ConfigMap mounts) against the gateway's rewritten URL.

Scaling down a pool = LWS deleting its group: SIGTERM to the leader pod's launcher, then (the
worker StatefulSet going with it) to the other pod's launcher.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsinfer.base.processes import free_port
from tests.test_deploy_chart import (
    CHART,
    LWS_GROUP_INDEX,
    LWS_WORKER_INDEX,
    container_env,
    flag,
    helm_binary,
    pod_spec,
    render,
    serve_argv,
)

pytestmark = pytest.mark.system

API_KEY = "deploy-test-key"
STARTUP_TIMEOUT = 150.0
DRAIN_BOUND = 45.0  # the profile's drain timeout (30 s) + kill grace + slack
MAX_LOAD_REQUESTS = 400


@dataclass
class Pod:
    name: str
    argv: list[str]
    env: dict[str, str]
    probes: dict[str, list[str]] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""


@dataclass
class Deployment:
    gateways: list[Pod]  # the replicas; pod IP 127.0.0.<i+1>
    pools: dict[tuple[str, int], list[Pod]]  # (role, group) -> pods, leader first
    port: int

    @property
    def gateway(self) -> Pod:
        return self.gateways[0]

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.{i + 1}:{self.port}" for i in range(len(self.gateways))]

    @property
    def url(self) -> str:
        return self.urls[0]

    def all_pods(self) -> list[Pod]:
        return [*self.gateways, *(p for pods in self.pools.values() for p in pods)]

    def metrics(self, url: str | None = None) -> str:
        return httpx.get(f"{url or self.url}/metrics", timeout=10).text

    def healthy_workers(self, url: str | None = None) -> set[str]:
        pattern = re.compile(r'^dsinfer_worker_healthy\{[^}]*worker="([^"]+)"[^}]*\} 1\.0$', re.MULTILINE)
        return set(pattern.findall(self.metrics(url)))

    def logs(self) -> str:
        return "\n".join(f"==== {p.name}\n{p.log()[-3000:]}" for p in self.all_pods())


def _replace_flag(argv: list[str], name: str, value: str) -> None:
    argv[argv.index(name) + 1] = value


def _local_python(argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "dsinfer.cli.main", *argv]


def plan_processes(docs: list[dict[str, Any]], gateway_url_in_cluster: str) -> Deployment:
    """Pods of the rendered objects as local processes (not started), with the rewrites above."""
    secrets = {d["metadata"]["name"]: d.get("stringData", {}) for d in docs if d["kind"] == "Secret"}
    deploy = next(d for d in docs if d["kind"] == "Deployment")
    container = pod_spec(deploy)["containers"][0]
    port, control = free_port(), free_port()
    gateways = []
    for replica in range(deploy["spec"]["replicas"]):
        env = container_env(container, {"status.podIP": f"127.0.0.{replica + 1}"}, secrets)
        argv = serve_argv(container, env)
        assert flag(argv, "--host") == f"127.0.0.{replica + 1}"  # its pod IP
        _replace_flag(argv, "--port", str(port))
        _replace_flag(argv, "--control-port", str(control))
        gateways.append(Pod(f"gateway-{replica}", _local_python(argv), env))
    control_addrs = ",".join(f"127.0.0.{i + 1}:{control}" for i in range(len(gateways)))
    pools: dict[tuple[str, int], list[Pod]] = {}
    for lws in (d for d in docs if d["kind"] == "LeaderWorkerSet"):
        size = lws["spec"]["leaderWorkerTemplate"]["size"]
        container = pod_spec(lws)["containers"][0]
        role = flag(container["args"], "--role")
        for group in range(lws["spec"]["replicas"]):
            dist_port = free_port()
            pods = []
            for worker in range(size):
                fields = {
                    "status.podIP": "127.0.0.1",
                    LWS_GROUP_INDEX: str(group),
                    LWS_WORKER_INDEX: str(worker),
                }
                env = {
                    "LWS_LEADER_ADDRESS": "127.0.0.1",
                    "LWS_GROUP_SIZE": str(size),
                    "LWS_WORKER_INDEX": str(worker),
                    **container_env(container, fields, secrets),
                }
                argv = serve_argv(container, env)
                assert flag(argv, "--gateway-addr").endswith("-gateway-control.llm.svc:8001")
                _replace_flag(argv, "--gateway-addr", control_addrs)
                if "--dist-init-addr" in argv:
                    assert flag(argv, "--dist-init-addr") == "127.0.0.1:29500"
                    _replace_flag(argv, "--dist-init-addr", f"127.0.0.1:{dist_port}")
                probes = {}
                for kind in ("readinessProbe", "livenessProbe"):
                    command = list(container[kind]["exec"]["command"])
                    assert command[:2] == ["python3", "/etc/dsinfer/probe/pool_probe.py"]
                    command[:2] = [sys.executable, str(CHART / "files/pool_probe.py")]
                    assert flag(command, "--gateway-url") == gateway_url_in_cluster
                    _replace_flag(command, "--gateway-url", f"http://127.0.0.1:{port}")
                    probes[kind] = command
                name = f"{lws['metadata']['name']}-{group}" + (f"-{worker}" if worker else "")
                pods.append(Pod(name, _local_python(argv), env, probes))
            pools[(role, group)] = pods
    return Deployment(gateways, pools, port)


def start(pod: Pod, log_dir: Path) -> None:
    pod.log_path = log_dir / f"{pod.name}.log"
    env = {**os.environ, **pod.env, "PYTHONUNBUFFERED": "1"}
    with pod.log_path.open("wb") as log:
        pod.process = subprocess.Popen(
            pod.argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def stop(pods: list[Pod], timeout: float) -> None:
    """SIGTERM to all (a pool drains only once all its pods do), a bounded wait, then SIGKILL;
    ranks die with their launcher (PR_SET_PDEATHSIG)."""
    procs = [p.process for p in pods if p.process is not None]
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def probe(pod: Pod, kind: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **pod.env}
    return subprocess.run(pod.probes[kind], env=env, capture_output=True, text=True, timeout=30, check=False)


def _logged_at(log: str, needle: str) -> str:
    """The timestamp ('YYYY-MM-DD HH:MM:SS,mmm', dsinfer's log format) of the line with ``needle``."""
    line = next((line for line in log.splitlines() if needle in line), None)
    assert line is not None, f"{needle!r} not logged:\n{log[-3000:]}"
    return line[:23]


def complete(url: str, prompt: str, max_tokens: int = 8, key: str | None = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    docs = render(helm_binary(tmp_path_factory), "values-cpu-tiny.yaml", f"apiKey.value={API_KEY}")
    in_cluster = "http://v3-dsinfer-gateway-internal.llm.svc:8000"
    dep = plan_processes(docs, in_cluster)
    assert sorted(dep.pools) == [("decode", 0), ("decode", 1), ("prefill", 0)]
    log_dir = tmp_path_factory.mktemp("deploy")
    try:
        for pod in dep.all_pods():
            start(pod, log_dir)
        expected = {"prefill/0/0", "decode/0/0", "decode/0/1", "decode/1/0", "decode/1/1"}
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            for pod in dep.all_pods():
                assert pod.process is not None
                assert pod.process.poll() is None, f"{pod.name} exited:\n{dep.logs()}"
            with contextlib.suppress(httpx.HTTPError):
                if all(expected <= dep.healthy_workers(url) for url in dep.urls):
                    break
            assert time.monotonic() < deadline, f"not all workers healthy:\n{dep.logs()}"
            time.sleep(0.5)
        yield dep
    finally:
        stop(dep.all_pods()[len(dep.gateways) :], timeout=20)  # pools drain before the gateways go
        stop(dep.gateways, timeout=10)


def test_rendered_cpu_profile_serves(deployment: Deployment) -> None:
    texts = []
    for url in deployment.urls:  # every replica routes to every pool
        assert httpx.get(f"{url}/ready", timeout=10).status_code == 200
        response = complete(url, "Hello")
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "length" and choice["text"]
        texts.append(choice["text"])
        assert complete(url, "Hello", key=None).status_code == 401  # the key came from the Secret
    assert len(set(texts)) == 1  # greedy: the same tokens whichever replica took the request
    for pods in deployment.pools.values():
        for pod in pods:
            ready, live = probe(pod, "readinessProbe"), probe(pod, "livenessProbe")
            assert ready.returncode == 0, ready.stdout + ready.stderr
            assert live.returncode == 0, live.stdout + live.stderr


def test_scaling_down_a_decode_pool_drains_deregisters_and_loses_no_request(deployment: Deployment) -> None:
    leaving = deployment.pools[("decode", 1)]
    results: list[tuple[float, int, str]] = []
    stop_load = threading.Event()

    def load(worker: int) -> None:
        i = 0
        while not stop_load.is_set() and len(results) < MAX_LOAD_REQUESTS:
            try:
                r = complete(deployment.url, f"request {worker}-{i} " + "word " * (i % 7), max_tokens=12)
                ok = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")
                results.append((time.monotonic(), r.status_code, "" if ok else r.text[:300]))
            except httpx.HTTPError as e:
                results.append((time.monotonic(), 0, repr(e)))
            i += 1

    threads = [threading.Thread(target=load, args=(w,), daemon=True) for w in range(3)]
    for t in threads:
        t.start()
    try:
        time.sleep(2.0)
        sigterm_at = time.monotonic()
        for pod in leaving:  # LWS deletes the group: leader first, its workers right after
            assert pod.process is not None
            pod.process.send_signal(signal.SIGTERM)
            time.sleep(0.3)
        for pod in leaving:
            assert pod.process is not None
            code = pod.process.wait(timeout=DRAIN_BOUND)
            assert code == 0, f"{pod.name} exited {code}:\n{pod.log()[-3000:]}"
        drained_at = time.monotonic()
        time.sleep(2.0)  # the remaining pools keep serving
    finally:
        stop_load.set()
        for t in threads:
            t.join(timeout=70)
    failures = [r for r in results if r[1] != 200 or r[2]]
    assert not failures, (
        f"{len(failures)} of {len(results)} requests failed: {failures[:5]}\n{deployment.logs()}"
    )
    during = [r for r in results if sigterm_at <= r[0] <= drained_at + 0.5]
    after = [r for r in results if r[0] > drained_at + 0.5]
    assert during and after, (len(results), len(during), len(after))
    for pod in leaving:
        log = pod.log()
        assert "draining incarnation" in log and "stopped (rank exit codes 0)" in log, log[-3000:]
    stopped = max(_logged_at(pod.log(), "stopped (rank exit codes") for pod in leaving)
    for gateway in deployment.gateways:  # every replica knew before the pool stopped
        for rank in (0, 1):
            deregistered = _logged_at(gateway.log(), f"worker decode/1/{rank} deregistered (drained)")
            assert deregistered <= stopped
    metrics = deployment.metrics()
    assert 'worker="decode/1/' not in metrics
    assert {"decode/0/0", "decode/0/1", "prefill/0/0"} <= deployment.healthy_workers()
    assert probe(leaving[0], "readinessProbe").returncode == 1  # gone from the gateway
    assert httpx.get(f"{deployment.url}/health", timeout=10).status_code == 200
