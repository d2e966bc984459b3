"""Intel AMX tile instructions inside numba kernels, and whether this process may run them.

A numba kernel names tiles by number (0-7, compile-time constants, as the instructions encode
them) and addresses memory as an array plus a byte offset, rows ``stride`` bytes apart:

- ``load_config(config)``: ``config`` is the 64-byte palette-1 tile configuration
  (:func:`tile_config`); every thread that runs tile instructions loads it first, and calls
  ``release()`` when done;
- ``zero(t)``, ``load(t, array, offset, stride)``, ``store(t, array, offset, stride)``;
- ``dot_bf16(c, a, b)``: ``tile c += tile a @ tile b``, where ``a`` holds M rows of K bf16
  values and ``b`` holds K/2 rows of N bf16 pairs (row ``k // 2`` packs the values of k and k+1 of
  each column: the "VNNI" layout), and ``c`` M x N float32. Products and sums are float32.

Linux lets a process use the tile registers only after it asks (``arch_prctl``); torch's
``_init_amx`` does that. :func:`amx_bf16_available` says whether both the CPU (as numba compiles
for it) and the kernel allow them here.
"""

from __future__ import annotations

import functools
from typing import Any

import numba
import numpy as np
import torch
from llvmlite import binding, ir
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = [
    "PAIR_CHANNELS",
    "TILES",
    "TILE_BYTES",
    "TILE_ROWS",
    "amx_bf16_available",
    "dot_bf16",
    "load",
    "load_config",
    "product_16",
    "product_64",
    "release",
    "store",
    "tile_config",
    "zero",
]

TILES = 8
TILE_ROWS = 16  # the most rows a tile holds
TILE_BYTES = 64  # the most bytes a tile row holds
PAIR_CHANNELS = TILE_BYTES // 2  # bf16 values per row of a left tile: the K of one tile product

_I8 = ir.IntType(8)
_PTR = ir.IntType(8).as_pointer()


def _call(builder: ir.IRBuilder, name: str, args: list[ir.Value]) -> None:
    fnty = ir.FunctionType(ir.VoidType(), [a.type for a in args])
    builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), args)


def _address(context: Any, builder: ir.IRBuilder, array_type: Any, array: Any, offset: ir.Value) -> ir.Value:
    data = context.make_array(array_type)(context, builder, value=array).data
    return builder.gep(builder.bitcast(data, _PTR), [offset])


@intrinsic
def load_config(typingctx: Any, config: Any) -> Any:
    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        _call(
            builder,
            "llvm.x86.ldtilecfg",
            [_address(context, builder, sig.args[0], args[0], ir.Constant(ir.IntType(64), 0))],
        )
        return context.get_dummy_value()

    return numba.types.void(config), codegen


@intrinsic
def release(typingctx: Any) -> Any:
    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        _call(builder, "llvm.x86.tilerelease", [])
        return context.get_dummy_value()

    return numba.types.void(), codegen


def _tile_numbers(*tiles: Any) -> tuple[int, ...] | None:
    """The tile numbers of a call, or None until numba types them as literals (it then retries)."""
    if not all(isinstance(t, numba.types.IntegerLiteral) for t in tiles):
        return None
    numbers = tuple(t.literal_value for t in tiles)
    if not all(0 <= n < TILES for n in numbers):
        raise numba.errors.TypingError(f"tile numbers must be 0-{TILES - 1}, got {numbers}")
    return numbers


def _memory(name: str) -> Any:
    def access(typingctx: Any, tile: Any, array: Any, offset: Any, stride: Any) -> Any:
        numbers = _tile_numbers(tile)
        if numbers is None:
            return None

        def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
            address = _address(context, builder, sig.args[1], args[1], args[2])
            _call(builder, name, [ir.Constant(_I8, numbers[0]), address, args[3]])
            return context.get_dummy_value()

        return numba.types.void(tile, array, numba.types.int64, numba.types.int64), codegen

    return intrinsic(access)


load = _memory("llvm.x86.tileloadd64")
store = _memory("llvm.x86.tilestored64")


@intrinsic
def zero(typingctx: Any, tile: Any) -> Any:
    numbers = _tile_numbers(tile)
    if numbers is None:
        return None

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        _call(builder, "llvm.x86.tilezero", [ir.Constant(_I8, numbers[0])])
        return context.get_dummy_value()

    return numba.types.void(tile), codegen


@intrinsic
def dot_bf16(typingctx: Any, c: Any, a: Any, b: Any) -> Any:
    numbers = _tile_numbers(c, a, b)
    if numbers is None:
        return None

    def codegen(context: Any, builder: ir.IRBuilder, sig: Any, args: Any) -> Any:
        _call(builder, "llvm.x86.tdpbf16ps", [ir.Constant(_I8, n) for n in numbers])
        return context.get_dummy_value()

    return numba.types.void(c, a, b), codegen


@numba.njit(cache=True, inline="always")
def product_64(weights, first, row_bytes, k_dim, pairs, out, out_row):
    """out[out_row : out_row + 64, :16] = W @ pairs (float32), where W is the 64 bf16 rows of
    ``k_dim`` channels starting at byte ``first`` of ``weights``, ``row_bytes`` apart, and
    ``pairs`` [k_dim / 2, 16] holds 16 columns' channels in pairs (uint32). Uses tiles 0-6, each
    configured as 16 rows of 64 bytes; a column's result depends on that column only."""
    zero(0)
    zero(1)
    zero(2)
    zero(3)
    tile = TILE_ROWS * row_bytes
    for k in range(0, k_dim, PAIR_CHANNELS):
        load(4, pairs, (k // 2) * TILE_BYTES, TILE_BYTES)
        at = first + 2 * k
        load(5, weights, at, row_bytes)
        dot_bf16(0, 5, 4)
        load(6, weights, at + tile, row_bytes)
        dot_bf16(1, 6, 4)
        load(5, weights, at + 2 * tile, row_bytes)
        dot_bf16(2, 5, 4)
        load(6, weights, at + 3 * tile, row_bytes)
        dot_bf16(3, 6, 4)
    store(0, out, out_row * TILE_BYTES, TILE_BYTES)
    store(1, out, (out_row + TILE_ROWS) * TILE_BYTES, TILE_BYTES)
    store(2, out, (out_row + 2 * TILE_ROWS) * TILE_BYTES, TILE_BYTES)
    store(3, out, (out_row + 3 * TILE_ROWS) * TILE_BYTES, TILE_BYTES)


@numba.njit(cache=True, inline="always")
def product_16(weights, first, row_bytes, k_dim, pairs, out, out_row):
    """:func:`product_64` for 16 rows of W (tiles 0, 4 and 5)."""
    zero(0)
    for k in range(0, k_dim, PAIR_CHANNELS):
        load(4, pairs, (k // 2) * TILE_BYTES, TILE_BYTES)
        load(5, weights, first + 2 * k, row_bytes)
        dot_bf16(0, 5, 4)
    store(0, out, out_row * TILE_BYTES, TILE_BYTES)


def tile_config(shapes: dict[int, tuple[int, int]]) -> np.ndarray:
    """The palette-1 configuration giving tile ``t`` ``shapes[t] = (rows, bytes per row)``."""
    config = np.zeros(64, dtype=np.uint8)
    config[0] = 1
    bytes_per_row, rows = config[16:48].view(np.uint16), config[48:64]
    for tile, (num_rows, row_bytes) in shapes.items():
        if not (0 <= tile < TILES and 0 < num_rows <= TILE_ROWS and 0 < row_bytes <= TILE_BYTES):
            raise ValueError(f"tile {tile}: {num_rows} rows of {row_bytes} bytes is not a tile")
        bytes_per_row[tile], rows[tile] = row_bytes, num_rows
    return config


def _numba_targets_amx_bf16() -> bool:
    """Whether numba compiles for a CPU with AMX tiles and bf16 (its own target, not only the host)."""
    features = numba.config.CPU_FEATURES
    if features is None:
        host = binding.get_host_cpu_features()
        return bool(host.get("amx-tile") and host.get("amx-bf16"))
    return "+amx-tile" in features and "+amx-bf16" in features


@functools.cache
def amx_bf16_available() -> bool:
    """AMX bf16 tiles usable by numba kernels in this process (asks the kernel for them once)."""
    return torch.cpu._is_amx_tile_supported() and _numba_targets_amx_bf16() and torch.cpu._init_amx()
