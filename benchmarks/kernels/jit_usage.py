"""Registers and spills of the Triton kernels a process actually launched, read from Triton's JIT
caches: the builds with the JIT's own specialization (argument divisibility, constants), which an
ahead-of-time compile with a hand-written signature only approximates.

    from jit_usage import jit_usage
    rows = jit_usage()   # after the kernels ran: one row per compiled specialization
"""

from __future__ import annotations

import importlib
from typing import Any

MODULES = (
    "dsinfer.kernels.mla_decode",
    "dsinfer.kernels.mla_decode_tma",
    "dsinfer.kernels.fp8_gemm",
    "dsinfer.kernels.grouped_gemm",
    "dsinfer.kernels.indexer",
    "dsinfer.kernels.sparse_mla",
    "dsinfer.kernels.moe_gate",
)


def _jit_functions() -> list[tuple[str, Any]]:
    from triton.runtime.jit import JITFunction

    found = []
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except Exception:  # a module the run never needed may not import here: nothing to read
            continue
        found += [(f"{name.rsplit('.', 1)[-1]}.{attr}", value) for attr, value in vars(module).items()
                  if isinstance(value, JITFunction)]  # fmt: skip
    return found


def _constexprs(fn: Any, constants: dict[Any, Any]) -> dict[str, str]:
    """The upper-case (tile) constexprs of one build; Triton keys them by name or by (index,)."""
    out = {}
    for key, value in constants.items():
        name = fn.arg_names[key[0]] if isinstance(key, tuple) and len(key) == 1 else str(key)
        if name.isupper():
            out[name] = str(value)
    return out


def jit_usage() -> list[dict[str, Any]]:
    """One row per compiled kernel: name, warps, stages, shared bytes, registers, spilled bytes
    (``n_spills``; ``None`` until the kernel was loaded on a device)."""
    rows = []
    for name, fn in _jit_functions():
        for caches in getattr(fn, "device_caches", {}).values():
            for compiled in caches[0].values():
                meta = compiled.metadata
                constants = _constexprs(fn, getattr(getattr(compiled, "src", None), "constants", None) or {})
                rows.append({
                    "kernel": name,
                    "constexprs": constants,
                    "num_warps": getattr(meta, "num_warps", None),
                    "num_stages": getattr(meta, "num_stages", None),
                    "shared_bytes": getattr(meta, "shared", None),
                    "registers": getattr(compiled, "n_regs", None),
                    "spills": getattr(compiled, "n_spills", None),
                })  # fmt: skip
    return rows
