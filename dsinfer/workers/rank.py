"""One rank of a pool: ``python -m dsinfer.workers.rank --args-json JSON`` (its launcher starts it).

This module is the rank's process: its device, its pool's groups, its engine, its sockets and
role, and their teardown; the loop it runs in lockstep with its pool is dsinfer/workers/step_loop.py.
SIGTERM drains: the rank refuses new requests, finishes what it holds, and the pool exits together
once every rank is stopping and no rank is busy.

In an elastic pool (``PoolArgs.elastic``: one node, several ranks) the group is formed and
re-formed by ``ElasticPool`` (dsinfer/workers/elastic.py): a collective that fails because a
peer died abandons the step and the survivors serve on in a new group; the agreed
``pool_generation`` re-forms the pool with a restarted rank (``RankArgs.joining``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import socket
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dsinfer.base.cluster_secret import ControlKeys, SecretError
from dsinfer.base.model_config import AnyModelConfig, read_model_config
from dsinfer.base.presets import resolve_model
from dsinfer.base.protocol import (
    HEARTBEAT_INTERVAL,
    Deregister,
    Heartbeat,
    Register,
    worker_name,
)
from dsinfer.base.rank_shape import expert_slots_per_rank
from dsinfer.base.tracing import Tracer
from dsinfer.engine.engine import LLMEngine
from dsinfer.parallel.ep import EPGroup, UnformedEPGroup
from dsinfer.parallel.ep_select import make_ep_group
from dsinfer.parallel.placement import ExpertPlacement
from dsinfer.transfer.base import TransferBackend
from dsinfer.transfer.factory import make_transfer_backend
from dsinfer.workers.args import PoolArgs, RankArgs
from dsinfer.workers.channel import WorkerChannel
from dsinfer.workers.decode import DecodeWorker
from dsinfer.workers.elastic import ElasticPool, PoolLost
from dsinfer.workers.membership import Membership, PoolStore, bound_store
from dsinfer.workers.prefill import PrefillWorker
from dsinfer.workers.role import ColocatedWorker, RoleWorker
from dsinfer.workers.step_loop import StepLoop

log = logging.getLogger("dsinfer.worker")

DIST_TIMEOUT = timedelta(minutes=10)  # start-up: ranks warm up (compile) at their own pace
RESOLVE_TIMEOUT = 120.0  # seconds rank 0 waits for --dist-init-addr's name to resolve
REFORM_TIMEOUT = 300.0  # seconds the members of a re-forming pool wait for each other


def rank_device(device: str, local_rank: int, gpus: int) -> str:
    """The device a pool rank runs on: with ``device`` "auto" or "cuda" each rank of a node takes
    its own GPU (``cuda:<local_rank>`` among the visible ones); an explicit ``cuda:N`` or "cpu" is
    kept as given. ``gpus``: the visible CUDA devices."""
    if device == "auto":
        device = "cuda" if gpus > 0 else "cpu"
    if device != "cuda":
        return device
    if local_rank >= gpus:
        raise ValueError(
            f"local rank {local_rank} needs GPU {local_rank}, but {gpus} are visible "
            "(a node runs one rank per GPU: spread the pool over more nodes with --nnodes, or "
            "make it smaller)"
        )
    return f"cuda:{local_rank}"


def process_group_backend(device: str) -> str:
    """NCCL for ranks on GPUs (DeepEP needs it), gloo for ranks on CPU."""
    return "nccl" if device.startswith("cuda") else "gloo"


def build_role(
    args: RankArgs, engine: LLMEngine, channel: WorkerChannel
) -> tuple[RoleWorker, TransferBackend | None]:
    pool = args.pool
    name = worker_name(pool.role, pool.pool_id, args.rank)
    if pool.role == "colocated":
        return ColocatedWorker(engine, channel, name, args.incarnation), None
    transfer = make_transfer_backend(pool.transfer_backend, f"{name}@{args.incarnation}", host=pool.host)
    transfer.register_pool(engine.kv_pages.regions())
    if pool.role == "prefill":
        worker = PrefillWorker(
            engine, channel, name, args.incarnation, transfer, quarantine=pool.kv_quarantine
        )
        return worker, transfer
    worker = DecodeWorker(
        engine,
        channel,
        name,
        args.incarnation,
        inbox=channel.inbox_addr,
        transfer_timeout=pool.kv_transfer_timeout,
        quarantine=pool.kv_quarantine,
    )
    return worker, transfer


def _model_config(pool: PoolArgs) -> AnyModelConfig:
    return read_model_config(resolve_model(pool.engine.model)[0] / "config.json")


def _ep_group(pool: PoolArgs, slots_per_rank: int) -> EPGroup:
    """The pool's expert-parallel group over the default group: DeepEP on NCCL when importable
    (``--ep-backend auto`` or ``deepep``), else torch all-to-all."""
    config = _model_config(pool)
    return make_ep_group(
        hidden=config.hidden_size,
        num_local_experts=slots_per_rank,
        top_k=config.num_experts_per_tok,
        low_latency=pool.role == "decode",
        max_tokens_per_rank=pool.engine.decode_tokens_per_step(),
        prefer=pool.engine.ep_backend,
    )


def _initial_placement(pool: PoolArgs) -> ExpertPlacement:
    """The placement the pool starts with (--placement, else the default layout)."""
    if pool.engine.placement is not None:
        return ExpertPlacement.load(pool.engine.placement)
    engine, config = pool.engine, _model_config(pool)
    return ExpertPlacement.for_model(
        config, pool.pool_size, engine.num_redundant_experts, int(engine.speculative_mtp)
    )


def _elastic_pool(args: RankArgs, backend: str) -> ElasticPool:
    pool = args.pool
    assert args.dist_store_file is not None  # the launcher's FileStore (an elastic pool is on one node)
    store = PoolStore.open(
        args.dist_store_file, args.pool_incarnation or args.incarnation, DIST_TIMEOUT.total_seconds()
    )
    return ElasticPool(
        args.rank,
        store,
        backend,
        lambda slots: _ep_group(pool, slots),
        initial=_initial_placement(pool),
        step_timeout=pool.ep_timeout,
        reform_timeout=REFORM_TIMEOUT,
    )


def rendezvous(args: RankArgs) -> dict[str, Any]:
    """How the pool's ranks meet (``init_process_group`` keywords): a FileStore in the launcher's
    private directory for a pool on one node, else rank 0's TCPStore at ``dist_init_addr``,
    listening on that address only."""
    if args.dist_store_file is not None:
        return {"init_method": f"file://{args.dist_store_file}"}
    host, port = args.dist_init_addr.rsplit(":", 1)
    host = host.strip("[]")
    if args.rank != 0:
        return {"store": dist.TCPStore(host, int(port), is_master=False, timeout=DIST_TIMEOUT)}
    deadline = time.monotonic() + RESOLVE_TIMEOUT
    while True:
        try:
            return {"store": bound_store(host, int(port), DIST_TIMEOUT.total_seconds())[0]}
        except socket.gaierror as e:  # a pod's DNS name may appear a little after the pod starts
            if time.monotonic() > deadline:
                raise RuntimeError(f"--dist-init-addr {args.dist_init_addr}: {e.strerror or e}") from None
            log.info("--dist-init-addr %s does not resolve yet (%s); retrying", args.dist_init_addr, e)
            time.sleep(1.0)
        except OSError as e:
            raise RuntimeError(
                f"rank 0 cannot listen on --dist-init-addr {args.dist_init_addr}: {e.strerror or e} "
                "(it must be an address of the pool's first node)"
            ) from None


@dataclasses.dataclass
class PoolGroups:
    """This rank's place in its pool: the expert-parallel group, the host-side group the per-step
    agreement runs over, the elastic pool (one node, several ranks) and a joining rank's target."""

    ep_group: EPGroup | None = None
    control: dist.ProcessGroup | None = None
    elastic: ElasticPool | None = None
    wanted: tuple[Membership, ExpertPlacement] | None = None


def join_pool(args: RankArgs, device: str) -> PoolGroups:
    pool = args.pool
    if pool.pool_size == 1:
        return PoolGroups()
    backend = process_group_backend(device)
    slots = expert_slots_per_rank(
        _model_config(pool).n_routed_experts, pool.engine.num_redundant_experts, pool.pool_size
    )
    if pool.elastic:
        elastic = _elastic_pool(args, backend)
        if args.joining:
            wanted = elastic.target()
            return PoolGroups(
                UnformedEPGroup(wanted[0].index(args.rank), len(wanted[0].ranks)), None, elastic, wanted
            )
        group = elastic.form(Membership(0, tuple(range(pool.pool_size))), slots, DIST_TIMEOUT.total_seconds())
        return PoolGroups(group, elastic.control, elastic)
    dist.init_process_group(
        backend, **rendezvous(args), rank=args.rank, world_size=pool.pool_size, timeout=DIST_TIMEOUT
    )
    control = dist.new_group(backend="gloo", timeout=DIST_TIMEOUT) if backend != "gloo" else None
    return PoolGroups(_ep_group(pool, slots), control)


def start_engine(args: RankArgs, device: str, groups: PoolGroups) -> LLMEngine:
    """The rank's engine, warmed up (or joined to its running pool) before anything is routed here."""
    pool = args.pool
    engine_args = pool.engine.model_copy(update={"device": device})
    if pool.role == "prefill":  # never runs a decode step: no CUDA graphs to capture
        engine_args = engine_args.model_copy(update={"enforce_eager": True})
    engine = LLMEngine(
        engine_args,
        ep_group=groups.ep_group,
        agreement_group=groups.control,
        placement=groups.wanted[1] if groups.wanted is not None else None,
    )
    elastic = groups.elastic
    if elastic is not None and groups.wanted is not None:
        elastic.join(engine, *groups.wanted)  # kernels come compiled from the cache its first start left
        return engine
    engine.warmup()  # compiles kernels before the gateway can route anything here
    if elastic is not None:
        elastic.serve()
        elastic.store.mark_serving(args.rank)
    return engine


def run_rank(args: RankArgs) -> int:
    pool = args.pool
    keys = ControlKeys.from_env()  # before the model loads: a missing secret fails at once
    threads = pool.threads
    torch.set_num_threads(threads)
    name = worker_name(pool.role, pool.pool_id, args.rank)
    device = rank_device(pool.engine.device, args.local_rank, torch.cuda.device_count())
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    groups = join_pool(args, device)
    engine = start_engine(args, device, groups)
    ep_group, elastic = groups.ep_group, groups.elastic
    channel = WorkerChannel(name, pool.gateway_addr, pool.host, keys)
    channel.start_heartbeat(Heartbeat(worker=name, incarnation=args.incarnation), HEARTBEAT_INTERVAL)
    role, transfer = build_role(args, engine, channel)
    role.trace_with(Tracer(f"dsinfer-{pool.role}", pool.otlp_traces_endpoint, {"dsinfer.worker": name}))
    loop = StepLoop(engine, role, channel, _register(args, engine, channel, transfer), transfer, elastic)
    # SIGTERM from here on drains (before: it ends the rank, which holds nothing yet)
    signal.signal(signal.SIGTERM, lambda signum, frame: loop.stop())
    log.info(
        "rank %s up on %s (incarnation %s, %d threads, inbox %s)",
        name,
        device,
        args.incarnation,
        threads,
        channel.inbox_addr,
    )
    try:
        loop.run()
    finally:
        channel.send_gateway(role.load_report(with_expert_load=True))
        channel.send_gateway(Deregister(worker=name, incarnation=args.incarnation))
        role.tracer.close()
        engine.close()
        if transfer is not None:
            transfer.close()
        channel.close()
        if ep_group is not None:
            ep_group.close()  # DeepEP's buffer goes before the process group (else it can hang)
        if dist.is_initialized():
            dist.destroy_process_group()
    log.info("rank %s stopped", name)
    return 0


def _register(
    args: RankArgs, engine: LLMEngine, channel: WorkerChannel, transfer: TransferBackend | None
) -> Register:
    """What the rank tells the gateways it is."""
    pool = args.pool
    return Register(
        worker=worker_name(pool.role, pool.pool_id, args.rank),
        role=pool.role,
        pool=pool.pool_id,
        incarnation=args.incarnation,
        inbox=channel.inbox_addr,
        transfer_agent=transfer.agent_name if transfer else "",
        transfer_metadata=transfer.metadata() if transfer else b"",
        kv_pages_total=engine.kv_pages.num_pages,
        page_size=engine.kv_pages.page_size,
        max_model_len=engine.max_model_len,
        model=engine.model_identity,
        rejoined=args.joining,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dsinfer-rank")
    parser.add_argument("--args-json", required=True)
    parser.add_argument("--log-level", default="INFO")
    ns = parser.parse_args(argv)
    logging.basicConfig(
        level=ns.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return run_rank(RankArgs.model_validate_json(ns.args_json))
    except PoolLost as e:
        log.error("rank leaves its pool: %s", e)
        return 1
    except SecretError as e:
        print(f"dsinfer: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
