"""Balancer by name: ``make_balancer(kind, role, page_size)``.

Kinds: ``"load"`` (the default policy: :class:`PrefillBalancer` for prefill and colocated ranks,
whose prefix cache is their own, :class:`DecodeBalancer` for decode ranks) and
``"round_robin"`` (the baseline).
"""

from __future__ import annotations

from dsinfer.balancers.base import Balancer
from dsinfer.balancers.decode import DecodeBalancer
from dsinfer.balancers.prefill import PrefillBalancer
from dsinfer.balancers.round_robin import RoundRobinBalancer
from dsinfer.base.protocol import ROLES

KINDS = ("load", "round_robin")
DEFAULT_KIND = "load"


def make_balancer(kind: str, role: str, page_size: int) -> Balancer:
    if kind not in KINDS:
        raise ValueError(f"unknown balancer kind {kind!r}; choose one of {', '.join(KINDS)}")
    if role not in ROLES:
        raise ValueError(f"unknown worker role {role!r}; choose one of {', '.join(ROLES)}")
    if kind == "round_robin":
        return RoundRobinBalancer()
    if role == "decode":
        return DecodeBalancer(page_size)
    return PrefillBalancer(page_size)
