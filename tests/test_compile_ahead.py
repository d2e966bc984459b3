"""Compiling the numba kernels ahead: the signature compiled ahead is the one every call uses,
and processes of a machine take the kernels one at a time under per-kernel file locks."""

from __future__ import annotations

import fcntl
import threading
import time
from pathlib import Path

import pytest

from dsinfer.engine.args import EngineArgs
from dsinfer.engine.engine import LLMEngine
from dsinfer.ops import compile_ahead, experts_amx, experts_cpu, mla_cpu, select_ops
from dsinfer.ops.compile_ahead import compile_shared


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ahead_signature_is_the_one_calls_use(dtype: str) -> None:
    ops = select_ops("cpu")
    amx = experts_amx.amx_bf16_available()
    assert ops.backends["mla"] == "numba" and ops.backends["experts"] == ("amx" if amx else "numba")
    compile_ahead(ops)
    engine = LLMEngine(EngineArgs(dtype=dtype, kv_cache_memory="16MiB"))
    engine.warmup()  # prefill and decode through both kernels
    # a call with other types would have compiled a second specialization
    assert len(mla_cpu._decode.signatures) == 1
    assert len(experts_cpu._experts.signatures) == 1
    assert len(experts_amx._experts.signatures) == (1 if amx else 0)


def test_a_kernel_locked_elsewhere_is_taken_last(tmp_path: Path) -> None:
    order: list[str] = []
    held = (tmp_path / "slow.lock").open("a")
    fcntl.flock(held, fcntl.LOCK_EX)  # another process is compiling "slow"
    kernels = {"slow": lambda: order.append("slow"), "fast": lambda: order.append("fast")}
    worker = threading.Thread(target=compile_shared, args=(kernels, tmp_path), daemon=True)
    worker.start()
    for _ in range(500):
        if order:
            break
        time.sleep(0.01)
    assert order == ["fast"]  # it did not wait for the held lock first
    fcntl.flock(held, fcntl.LOCK_UN)
    held.close()
    worker.join(timeout=30)
    assert not worker.is_alive()
    assert order == ["fast", "slow"]
