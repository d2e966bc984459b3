"""The pools of an all-in-one server (``dsinfer serve`` without ``--role``) and their threads."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from dsinfer.cli.errors import UsageError
from dsinfer.workers.args import shared_cores


@dataclass(frozen=True)
class PoolSpec:
    role: str
    pool_id: int
    size: int

    @property
    def name(self) -> str:
        return f"{self.role} pool {self.pool_id}"


@dataclass(frozen=True)
class Layout:
    """The pools of an all-in-one server and the torch threads of each role's ranks.

    The ranks of one role share the machine's cores; prefill and decode each get all of them,
    because on one machine their busy spells mostly alternate (a burst is prefilled, then
    decoded), and a decode rank left on half the cores while the prefill rank idles was measured
    14-21% slower (benchmarks/results/serving_throughput.md)."""

    pools: tuple[PoolSpec, ...]
    threads_by_role: dict[str, int]

    @property
    def num_ranks(self) -> int:
        return sum(p.size for p in self.pools)


def layout_of(args: argparse.Namespace) -> Layout:
    for flag in ("prefill_pool_size", "decode_pool_size", "prefill_pools", "decode_pools"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.colocated:
        pools = tuple(PoolSpec("colocated", i, args.decode_pool_size) for i in range(args.decode_pools))
    else:
        pools = tuple(PoolSpec("prefill", i, args.prefill_pool_size) for i in range(args.prefill_pools))
        pools += tuple(PoolSpec("decode", i, args.decode_pool_size) for i in range(args.decode_pools))
    threads: dict[str, int] = {}
    for role in {p.role for p in pools}:
        ranks = sum(p.size for p in pools if p.role == role)
        threads[role] = args.threads_per_rank or shared_cores(ranks)
    return Layout(pools, threads)
