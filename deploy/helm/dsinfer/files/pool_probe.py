#!/usr/bin/env python3
"""Kubernetes exec probe of one dsinfer pool pod (one node of a pool), stdlib only.

Pool ranks have no HTTP endpoint of their own: they register with the gateway and send it load
reports, so the gateway's /metrics (``dsinfer_worker_healthy{worker="<role>/<pool>/<rank>"}``) is
where their health is seen. This pod's pool id and node rank come from the environment
(DSINFER_POOL_ID, DSINFER_NODE_RANK: the LeaderWorkerSet group and worker index); its ranks are
``node_rank * ranks_per_node`` .. ``+ ranks_per_node - 1``.

- ``ready``: exit 0 when every rank of this pod is registered and healthy at the gateway (startup
  and readiness: the model is loaded and the ranks serve); 1 otherwise.
- ``live``: exit 1 only when the gateway answers and reports a rank of this pod unhealthy (its
  heartbeats stopped, or its pool went down and has not come back); a gateway that cannot be
  reached, or ranks not registered yet, say nothing about this pod and pass. The probe's
  failure threshold must outlast a pool restart (the launcher reloads the model in place).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import urllib.request

SERIES = re.compile(r'^dsinfer_worker_healthy\{[^}]*worker="([^"]+)"[^}]*\}\s+(\S+)', re.MULTILINE)


def worker_health(gateway_url: str, timeout: float) -> dict[str, float]:
    with urllib.request.urlopen(gateway_url.rstrip("/") + "/metrics", timeout=timeout) as response:
        text = response.read().decode("utf-8", errors="replace")
    return {m.group(1): float(m.group(2)) for m in SERIES.finditer(text)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pool_probe", description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("ready", "live"))
    parser.add_argument("--gateway-url", required=True, help="http://HOST:PORT of the gateway")
    parser.add_argument("--role", required=True, choices=("prefill", "decode", "colocated"))
    parser.add_argument("--ranks-per-node", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args(argv)
    try:
        pool, node = int(os.environ["DSINFER_POOL_ID"]), int(os.environ["DSINFER_NODE_RANK"])
    except (KeyError, ValueError) as e:
        print(f"pool_probe: DSINFER_POOL_ID and DSINFER_NODE_RANK must be integers ({e})")
        return 1
    first = node * args.ranks_per_node
    workers = [f"{args.role}/{pool}/{rank}" for rank in range(first, first + args.ranks_per_node)]
    try:
        health = worker_health(args.gateway_url, args.timeout)
    except (OSError, ValueError) as e:
        if args.mode == "live":
            print(f"gateway {args.gateway_url} not reachable ({e}): nothing known against this pod")
            return 0
        print(f"gateway {args.gateway_url} not reachable: {e}")
        return 1
    if args.mode == "ready":
        waiting = [w for w in workers if health.get(w) != 1.0]
        if waiting:
            print(f"not ready: {', '.join(waiting)} not healthy at the gateway yet")
            return 1
        print(f"ready: {', '.join(workers)}")
        return 0
    down = [w for w in workers if health.get(w) == 0.0]
    if down:
        print(f"unhealthy at the gateway: {', '.join(down)}")
        return 1
    print(f"alive: {', '.join(workers)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
