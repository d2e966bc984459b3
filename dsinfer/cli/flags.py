"""What the serve commands share about their flags: which are a pool process's own, and the flags
an ``add_*_args`` function defines."""

from __future__ import annotations

import argparse
from collections.abc import Callable

# flags only a pool process (--role prefill|decode|colocated) takes: the all-in-one server sets them
POOL_ONLY = ("pool_size", "pool_id", "nnodes", "node_rank", "dist_init_addr", "gateway_addr", "gpu_memory")
# pool flags (add_pool_args) that the gateway reads as well: one flag sets both
SHARED_WITH_GATEWAY = ("drain_timeout", "otlp_traces_endpoint")


def actions_of(add: Callable[[argparse.ArgumentParser], None]) -> list[argparse.Action]:
    """The flags a ``add_*_args`` function defines."""
    parser = argparse.ArgumentParser(add_help=False)
    add(parser)
    return list(parser._actions)
