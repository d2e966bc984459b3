"""Two DeepSeek-V4 micro-batches through the decoder layers, in the schedules of
dsinfer/model/overlap.py (the same chunks, order and checks as V3's), so that one micro-batch's
expert dispatch or combine is in flight while the other computes.

A layer's stages (``V4DecoderLayer.attention``, ``ffn_in``; ``V4MoE.begin``, ``run_experts``,
``end``, its shared expert):

- prefill: ATTN (mHC, attention over each sequence, the MoE's input, its gate; dispatch posted),
  MLP (wait dispatch, routed experts; combine posted), SHARED (shared expert, wait combine, back
  into the streams);
- decode: ATTN-0 (the previous layer's combine waited and summed into the streams, then this
  layer's attention: its pages are written here), ATTN-1 (the MoE's input, its gate; dispatch
  posted), SHARED (shared expert), MLP (wait dispatch, routed experts; combine posted); FINISH
  after the last layer.

A micro-batch without sequences skips attention but joins every exchange, as V3's does. The math
of each micro-batch is the one-micro-batch forward's over its sequences.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from dsinfer.base.trace import Tracer
from dsinfer.model.deepseek_v4 import DeepseekV4ForCausalLM, V4DecoderLayer, V4Step
from dsinfer.model.hyper_connection import HyperConnection
from dsinfer.model.overlap import FINISH, PREFILL, Chunk, drive, wait_transfer
from dsinfer.model.v4_moe import V4Routed
from dsinfer.model.v4_state import SequenceState


@dataclass
class V4MicroBatch:
    token_ids: torch.Tensor  # [T] (empty: no sequence of this rank in it)
    states: list[SequenceState]
    q_lens: list[int]
    undo: list[bool] | None = None  # the sequences whose step may be taken back in part (MTP)
    hidden: torch.Tensor | None = None  # final-normed output [T, H], set by its last chunk
    streams: torch.Tensor | None = None  # the last layer's streams [T, hc_mult, H], with it


@dataclass
class _Pending:
    """A layer's MoE between its chunks: the input, the weights back into the streams, the work."""

    layer: V4DecoderLayer
    x: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor
    work: V4Routed
    shared: torch.Tensor | None = None


class _Stages:
    def __init__(self, model: DeepseekV4ForCausalLM, tracer: Tracer | None) -> None:
        self.model, self.tracer = model, tracer
        self.layers: list[V4DecoderLayer] = list(model.layers)

    def run(self, order: str, index: int, mb: V4MicroBatch) -> Iterator[Chunk]:
        return self._prefill(index, mb) if order == PREFILL else self._decode(index, mb)

    def _attention(
        self, layer: V4DecoderLayer, streams: torch.Tensor, step: V4Step, mb: V4MicroBatch
    ) -> torch.Tensor:
        if not mb.states:
            return streams
        return layer.attention(streams, step, mb.states, mb.undo)

    def _begin(self, layer: V4DecoderLayer, streams: torch.Tensor, mb: V4MicroBatch) -> _Pending:
        x, post, comb = layer.ffn_in(streams)
        return _Pending(layer, x, post, comb, layer.ffn.begin(x, mb.token_ids))

    def _end(self, streams: torch.Tensor, pending: _Pending, i: int, n: int) -> torch.Tensor:
        ffn = pending.layer.ffn
        combined = wait_transfer(pending.work.combine, "COMBINE", i, n, self.tracer)
        assert combined is not None and pending.shared is not None
        h = ffn.end(pending.work, combined) + pending.shared
        return HyperConnection.expand(streams, h, pending.post, pending.comb)

    def _experts(self, pending: _Pending, i: int, n: int) -> None:
        received = wait_transfer(pending.work.dispatch, "DISPATCH", i, n, self.tracer)
        assert received is not None
        pending.layer.ffn.run_experts(pending.work, received)

    def _prefill(self, i: int, mb: V4MicroBatch) -> Iterator[Chunk]:
        step = self.model.start(mb.token_ids, mb.states, mb.q_lens)
        streams = step.streams
        for n, layer in enumerate(self.layers):
            streams = self._attention(layer, streams, step, mb)
            pending = self._begin(layer, streams, mb)
            yield Chunk("ATTN", n)
            self._experts(pending, i, n)
            yield Chunk("MLP", n)
            pending.shared = layer.ffn.shared_experts(pending.x)
            streams = self._end(streams, pending, i, n)
            if n == len(self.layers) - 1:
                mb.streams, mb.hidden = streams, self.model.finish(streams, mb.states, mb.q_lens)
            yield Chunk("SHARED", n)

    def _decode(self, i: int, mb: V4MicroBatch) -> Iterator[Chunk]:
        step = self.model.start(mb.token_ids, mb.states, mb.q_lens)
        streams = step.streams
        previous: tuple[int, _Pending] | None = None
        for n, layer in enumerate(self.layers):
            if previous is not None:
                streams = self._end(streams, previous[1], i, previous[0])
            streams = self._attention(layer, streams, step, mb)
            yield Chunk("ATTN-0", n)
            pending = self._begin(layer, streams, mb)
            yield Chunk("ATTN-1", n)
            pending.shared = layer.ffn.shared_experts(pending.x)
            yield Chunk("SHARED", n)
            self._experts(pending, i, n)
            yield Chunk("MLP", n)
            previous = (n, pending)
        if previous is not None:
            streams = self._end(streams, previous[1], i, previous[0])
        mb.streams, mb.hidden = streams, self.model.finish(streams, mb.states, mb.q_lens)
        yield Chunk(FINISH, len(self.layers) - 1)


@torch.inference_mode()
def forward_two_v4(
    model: DeepseekV4ForCausalLM,
    micro_batches: tuple[V4MicroBatch, V4MicroBatch],
    order: str,
    *,
    tracer: Tracer | None = None,
    after_layer: Callable[[int], None] | None = None,
) -> None:
    """Both micro-batches through the layers in ``order``'s schedule; sets their ``hidden``.
    Every rank of the pool must run the same ``order`` (the exchanges pair up)."""
    if model.ep is None:
        raise ValueError("two micro-batches overlap expert-parallel exchanges: the model has no EP group")
    stages = _Stages(model, tracer)
    gens = [stages.run(order, i, mb) for i, mb in enumerate(micro_batches)]
    drive(gens, order, len(stages.layers), tracer, after_layer)
