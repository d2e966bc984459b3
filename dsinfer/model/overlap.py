"""Two micro-batches through the decoder layers, interleaved as DeepSeek's published schedules.

Each micro-batch runs the layers' stages (dsinfer/model/deepseek_v3.py) as a generator that
yields the chunk it has just finished; :func:`forward_two` advances the two generators in the
published order and checks every chunk against it. The math of each micro-batch is exactly the
one-micro-batch forward's over its rows: only the order of independent work changes, so that one
micro-batch's dispatch or combine is in flight while the other computes.

Prefill, per micro-batch and layer: ATTN (norm, MLA, residual, post-norm, gate; dispatch posted),
MLP (wait dispatch, routed experts; combine posted), SHARED (shared experts, wait combine,
residual). Per layer slot l: ATTN(1) SHARED(0) ATTN(0) MLP(1) MLP(0) SHARED(1), where SHARED(0)
is layer l-1's (micro-batch 0 trails by that chunk), so the combine of 0 runs under ATTN(1),
dispatch 1 under SHARED(0) ATTN(0), dispatch 0 under MLP(1) and combine 1 under MLP(0).

Decode, per micro-batch and layer: ATTN-0 (finish the previous layer's combine, residual, norm,
MLA projections, latent cache written), ATTN-1 (core attention, o_proj, residual, post-norm,
gate; dispatch posted), SHARED (shared experts), MLP (wait dispatch, routed experts; combine
posted); after the last layer FINISH (wait combine, residual, final norm) takes ATTN-0's place.
Per slot l: SHARED(0) ATTN-0(1) MLP(0) ATTN-1(1) SHARED(1) ATTN-0(0) MLP(1) ATTN-1(0), where
micro-batch 0's SHARED and MLP are layer l-1's.

A micro-batch without tokens (``batch`` None) skips attention but joins every MoE transfer, so an
idle rank, or a rank with a single sequence, pairs the collectives of the others.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import torch

from dsinfer.base.trace import COMM, COMPUTE, Tracer, now_ns
from dsinfer.model.batch import ForwardBatch, LayerCache
from dsinfer.model.deepseek_v3 import DecoderLayer, DeepseekV3ForCausalLM, FeedForward
from dsinfer.parallel.ep import Pending

PREFILL, DECODE = "prefill", "decode"
ORDERS = (PREFILL, DECODE)
FINISH = "FINISH"

# (stage, micro-batch, layer offset) of one layer slot, in execution order
PREFILL_SLOT = (
    ("ATTN", 1, 0),
    ("SHARED", 0, -1),
    ("ATTN", 0, 0),
    ("MLP", 1, 0),
    ("MLP", 0, 0),
    ("SHARED", 1, 0),
)
DECODE_SLOT = (
    ("SHARED", 0, -1),
    ("ATTN-0", 1, 0),
    ("MLP", 0, -1),
    ("ATTN-1", 1, 0),
    ("SHARED", 1, 0),
    ("ATTN-0", 0, 0),
    ("MLP", 1, 0),
    ("ATTN-1", 0, 0),
)
_KV_WRITTEN_BY = ("ATTN", "ATTN-0")  # the chunk that writes a layer's latent cache

T = TypeVar("T")


class Chunk(NamedTuple):
    stage: str
    layer: int

    def label(self, mb: int) -> str:
        return f"{self.stage}({mb}) L{self.layer}"


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [T] (empty when this rank has no tokens in it)
    batch: ForwardBatch | None  # None: no tokens
    hidden: torch.Tensor | None = None  # final-normed output [T, H], set by its last chunk


def schedule(order: str, num_layers: int) -> list[tuple[int, Chunk]]:
    """The (micro-batch, chunk) sequence of a forward over ``num_layers`` layers."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    slot = PREFILL_SLOT if order == PREFILL else DECODE_SLOT
    out = []
    for base in range(num_layers + 1):
        for stage, mb, offset in slot:
            layer = base + offset
            if stage == "ATTN-0" and layer == num_layers:
                out.append((mb, Chunk(FINISH, num_layers - 1)))
            elif 0 <= layer < num_layers:
                out.append((mb, Chunk(stage, layer)))
    return out


class _Stages:
    """The per-micro-batch generators over one model's decoder layers."""

    def __init__(
        self, model: DeepseekV3ForCausalLM, kv_caches: list[LayerCache], tracer: Tracer | None
    ) -> None:
        self.model, self.tracer = model, tracer
        self.layers: list[DecoderLayer] = list(model.model.layers)
        self.kv_caches = kv_caches

    def run(self, order: str, index: int, mb: MicroBatch) -> Iterator[Chunk]:
        return self._prefill(index, mb) if order == PREFILL else self._decode(index, mb)

    def _prefill(self, i: int, mb: MicroBatch) -> Iterator[Chunk]:
        x = self.model.model.embed_tokens(mb.input_ids)
        for n, layer in enumerate(self.layers):
            if mb.batch is not None:
                q = layer.attention_in(x, mb.batch, self.kv_caches[n])
                x = layer.attention_out(x, q, mb.batch, self.kv_caches[n])
            ffn = layer.ffn_begin(x)
            yield Chunk("ATTN", n)
            layer.ffn_experts(ffn, self._wait(ffn.dispatch, "DISPATCH", i, n))
            yield Chunk("MLP", n)
            layer.ffn_shared(ffn)
            x = layer.ffn_end(x, ffn, self._wait(ffn.combine, "COMBINE", i, n))
            if n == len(self.layers) - 1:
                mb.hidden = self.model.model.norm(x)
            yield Chunk("SHARED", n)

    def _decode(self, i: int, mb: MicroBatch) -> Iterator[Chunk]:
        x = self.model.model.embed_tokens(mb.input_ids)
        previous: tuple[int, FeedForward] | None = None
        for n, layer in enumerate(self.layers):
            if previous is not None:
                x = self._finish(x, i, *previous)
            q = layer.attention_in(x, mb.batch, self.kv_caches[n]) if mb.batch is not None else None
            yield Chunk("ATTN-0", n)
            if mb.batch is not None and q is not None:
                x = layer.attention_out(x, q, mb.batch, self.kv_caches[n])
            ffn = layer.ffn_begin(x)
            yield Chunk("ATTN-1", n)
            layer.ffn_shared(ffn)
            yield Chunk("SHARED", n)
            layer.ffn_experts(ffn, self._wait(ffn.dispatch, "DISPATCH", i, n))
            yield Chunk("MLP", n)
            previous = (n, ffn)
        if previous is not None:
            x = self._finish(x, i, *previous)
        mb.hidden = self.model.model.norm(x)
        yield Chunk(FINISH, len(self.layers) - 1)

    def _finish(self, x: torch.Tensor, i: int, n: int, ffn: FeedForward) -> torch.Tensor:
        return self.layers[n].ffn_end(x, ffn, self._wait(ffn.combine, "COMBINE", i, n))

    def _wait(self, pending: Pending[T] | None, what: str, mb: int, layer: int) -> T | None:
        return wait_transfer(pending, what, mb, layer, self.tracer)


def wait_transfer(
    pending: Pending[T] | None, what: str, mb: int, layer: int, tracer: Tracer | None
) -> T | None:
    """Wait for a transfer. Traced: the transfer (posted -> completed) on the comm thread; on the
    compute thread, as "wait" spans, the time blocked in its synchronous preamble (the counts
    exchange, inside the chunk that posted it) and in this wait."""
    if pending is None:
        return None
    start = now_ns()
    value = pending.wait()
    if tracer is not None:
        end = now_ns()
        completed = pending.completed_ns if pending.completed_ns is not None else end
        name, args = f"{what}({mb}) L{layer}", {"mb": mb, "layer": layer}
        tracer.add(name, COMM, pending.posted_ns, completed, cat="comm", **args)
        if pending.posted_ns > pending.issued_ns:
            tracer.add(f"post {name}", COMPUTE, pending.issued_ns, pending.posted_ns, cat="wait", **args)
        tracer.add(f"wait {name}", COMPUTE, start, end, cat="wait", **args)
    return value


@torch.inference_mode()
def forward_two(
    model: DeepseekV3ForCausalLM,
    micro_batches: tuple[MicroBatch, MicroBatch],
    kv_caches: list[LayerCache],
    order: str,
    *,
    tracer: Tracer | None = None,
    after_layer: Callable[[int], None] | None = None,
) -> None:
    """Both micro-batches through the decoder layers in ``order``'s schedule; sets their ``hidden``.

    ``after_layer(i)`` is called once both micro-batches have written layer i's latent cache.
    Every rank of an expert-parallel pool must run the same ``order`` (the transfers pair up).
    """
    stages = _Stages(model, kv_caches, tracer)
    gens = [stages.run(order, i, mb) for i, mb in enumerate(micro_batches)]
    drive(gens, order, len(stages.layers), tracer, after_layer)


def drive(
    gens: list[Iterator[Chunk]],
    order: str,
    num_layers: int,
    tracer: Tracer | None,
    after_layer: Callable[[int], None] | None,
) -> None:
    """Advance the two micro-batches' generators in ``order``'s schedule, checking every chunk,
    and call ``after_layer(i)`` once both have written layer i's cache."""
    written, announced = [0, 0], 0
    for mb, chunk in schedule(order, num_layers):
        start = now_ns()
        done = next(gens[mb], None)
        if done != chunk:
            raise RuntimeError(f"micro-batch {mb} finished {done}; the {order} schedule expected {chunk}")
        if tracer is not None:
            tracer.add(
                chunk.label(mb), COMPUTE, start, now_ns(), cat="chunk", mb=mb, layer=chunk.layer, order=order
            )
        if chunk.stage in _KV_WRITTEN_BY:
            written[mb] = chunk.layer + 1
        while after_layer is not None and announced < min(written):
            after_layer(announced)
            announced += 1
    for mb, gen in enumerate(gens):
        extra = next(gen, None)
        if extra is not None:
            raise RuntimeError(f"micro-batch {mb} has {extra} left after the {order} schedule")
