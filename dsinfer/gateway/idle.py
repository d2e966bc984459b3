"""What an idle gateway does for its memory: after a burst or refused multi-MB bodies, collect
garbage cycles and give the heap's free pages back to the OS (dsinfer/base/heap.py)."""

from __future__ import annotations

import asyncio
import gc

import psutil

from dsinfer.base import heap
from dsinfer.gateway.request_run import GatewayContext

TRIM_EVERY = 5.0  # seconds between checks for an idle gateway whose heap may be trimmed
TRIM_GROWTH = 16 << 20  # bytes of growth since the last trim that make a trim worth it


async def trim_when_idle(ctx: GatewayContext, every: float = TRIM_EVERY, growth: int = TRIM_GROWTH) -> None:
    """Every ``every`` s with no request running and the resident size ``growth`` bytes over
    what the last trim left, garbage cycles are collected and the heap's free pages go back
    to the OS: the memory of a burst, or of refused multi-MB bodies, returns."""
    process = psutil.Process()
    left = process.memory_info().rss
    while True:
        await asyncio.sleep(every)
        if not ctx.active_ids and process.memory_info().rss > left + growth:
            gc.collect()  # an error's traceback is a cycle that holds its request's body until then
            await asyncio.to_thread(heap.trim)
            left = process.memory_info().rss
