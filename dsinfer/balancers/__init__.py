"""Gateway-side load balancers: pure policies that pick a worker rank for each worker request.

- :mod:`.prefill`: core-attention load and input tokens per prefill rank, with prefix affinity.
- :mod:`.decode`: KV cache usage and request count per decode rank.
- :mod:`.round_robin`: the baseline.
- :mod:`.registry`: ``make_balancer(kind, role, page_size)``.

Each module's docstring states its exact formulas.
"""

from dsinfer.balancers.base import Balancer, RouteRequest
from dsinfer.balancers.decode import DecodeBalancer
from dsinfer.balancers.factory import DEFAULT_KIND, KINDS, make_balancer
from dsinfer.balancers.prefill import PrefillBalancer
from dsinfer.balancers.round_robin import RoundRobinBalancer

__all__ = [
    "DEFAULT_KIND",
    "KINDS",
    "Balancer",
    "DecodeBalancer",
    "PrefillBalancer",
    "RoundRobinBalancer",
    "RouteRequest",
    "make_balancer",
]
