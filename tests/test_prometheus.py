"""The chart's dashboard and alerts against a real Prometheus (Debian's ``prometheus`` package:
the server and ``promtool``; .ci/run installs it): the rules the chart renders pass ``promtool
check rules``; Prometheus scrapes a running all-in-one server under a little load and evaluates
them; then every dashboard panel's expression, every recorded series and every alert's expression
(what it compares with its threshold) returns data, and every rule evaluates without an error.
No panel may query a metric the server does not export."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from dsinfer.base.processes import free_port
from harness.server import Server, running, serve
from tests.test_deploy_chart import CHART, helm_binary, render

pytestmark = [
    pytest.mark.system,
    pytest.mark.skipif(
        shutil.which("prometheus") is None or shutil.which("promtool") is None,
        reason="needs Debian's prometheus package (apt-get install prometheus; .ci/run installs it)",
    ),
]

SCRAPE_SECONDS = 1
DATA_TIMEOUT = 90.0  # seconds for every expression to have data once the load runs
COMPARISON = re.compile(r"^(?P<measure>.+?)\s*(?:>|<|==|!=|>=|<=)\s*[0-9.e+-]+$")


def _dashboard_expressions() -> list[tuple[str, str]]:
    """(panel title, expression) of every query of the shipped dashboard."""
    dashboard = json.loads((CHART / "files/grafana-dashboard.json").read_text())
    return [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def _rendered_rules(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The PrometheusRule's spec the chart renders (alerts on), as a Prometheus rules file."""
    docs = render(helm_binary(tmp_path_factory), "values-h800.yaml")
    (spec,) = [doc["spec"] for doc in docs if doc["kind"] == "PrometheusRule"]
    (dashboard,) = [
        doc for doc in docs if doc["kind"] == "ConfigMap" and doc["metadata"]["name"].endswith("-dashboard")
    ]
    assert json.loads(dashboard["data"]["dsinfer.json"]) == json.loads(
        (CHART / "files/grafana-dashboard.json").read_text()
    )
    return spec


def _query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    reply = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert reply["status"] == "success", f"{expr}: {reply}"
    return reply["data"]["result"]


def _load(base_url: str, stop: threading.Event) -> None:
    """Streamed chats, completions and one bad request per round until ``stop``."""
    with httpx.Client(base_url=base_url, timeout=60) as client:
        while not stop.is_set():
            chat = {"model": "tiny-chat", "messages": [{"role": "user", "content": "What is 17 + 25?"}]}
            with client.stream(
                "POST", "/v1/chat/completions", json={**chat, "stream": True, "max_tokens": 8}
            ) as r:
                r.read()
            client.post(
                "/v1/completions", json={"model": "tiny-chat", "prompt": "12 + 30 =", "max_tokens": 4}
            )
            client.post("/v1/completions", json={"model": "tiny-chat", "prompt": "x", "max_tokens": -1})


def test_dashboard_and_alerts_have_data(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    rules = _rendered_rules(tmp_path_factory)
    rules_file = tmp_path / "rules.yml"
    rules_file.write_text(yaml.safe_dump(rules))
    check = subprocess.run(
        ["promtool", "check", "rules", str(rules_file)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
    records = [rule["record"] for group in rules["groups"] for rule in group["rules"] if "record" in rule]
    alerts = {
        rule["alert"]: rule["expr"] for group in rules["groups"] for rule in group["rules"] if "alert" in rule
    }
    measures = {}
    for name, expr in alerts.items():
        match = COMPARISON.match(expr.strip())
        assert match, f"alert {name}: {expr!r} is not '<measure> <comparison> <threshold>'"
        measures[f"alert {name}"] = match["measure"]

    with serve([], tmp_path) as server:
        port = server.base_url.rsplit(":", 1)[1]
        config = {
            "global": {"scrape_interval": f"{SCRAPE_SECONDS}s", "evaluation_interval": f"{SCRAPE_SECONDS}s"},
            "rule_files": [str(rules_file)],
            "scrape_configs": [
                {"job_name": "dsinfer", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
            ],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        prom_port = free_port()
        argv = [
            "prometheus",
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
        ]
        prometheus = Server(argv, prom_port, tmp_path / "prometheus.log")
        stop = threading.Event()
        loader = threading.Thread(target=_load, args=(server.base_url, stop), daemon=True)
        with running(prometheus, 60, ready=lambda: prometheus.answers("/-/ready")):
            loader.start()
            try:
                wanted = {f"panel {title!r}": expr for title, expr in _dashboard_expressions()}
                wanted |= {f"record {name}": name for name in records} | measures
                deadline, empty = time.monotonic() + DATA_TIMEOUT, dict(wanted)
                while empty and time.monotonic() < deadline:
                    empty = {
                        what: expr for what, expr in empty.items() if not _query(prometheus.base_url, expr)
                    }
                    time.sleep(SCRAPE_SECONDS)
                assert not empty, f"no data after {DATA_TIMEOUT:.0f} s: {empty}\n{prometheus.log_tail()}"
                for expr in alerts.values():
                    _query(prometheus.base_url, expr)  # the whole expression evaluates
                groups = httpx.get(f"{prometheus.base_url}/api/v1/rules", timeout=10).json()["data"]["groups"]
                broken = [
                    (r["name"], r.get("lastError")) for g in groups for r in g["rules"] if r["health"] != "ok"
                ]
                assert not broken, broken
            finally:
                stop.set()
                loader.join(timeout=70)
