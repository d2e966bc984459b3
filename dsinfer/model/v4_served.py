"""DeepSeek-V4 behind the engine's model interface (what ``ModelRunner`` calls on V3's model).

The engine schedules V4 like V3: chunked prefill, decodes batched, pages charged per 256 tokens.
Its compressed entries and indexer keys are written to and read from the sequence's pages; its
window rows and compressor state are the sequence's own (dsinfer/model/v4_paged.py), found by the
batch's sequence keys, with resume points at page boundaries for the prefix cache and the PD
handoff. A KV connector's per-layer hook runs once the whole forward is done (the layers' pages
are written as the model runs its sequences one by one). In an expert-parallel pool each rank
attends its own sequences and holds its expert slots (dsinfer/model/v4_moe.py); a rank without
tokens runs the layers' MoE exchanges alone (``idle_forward``). No CUDA graphs.

MTP: a step keeps the last layer's streams, which the MTP layer reads
(``mtp_input``), and its verifications' undo records; once the target has sampled, a rejected
draft's token is taken back out of its sequence's state (``settle_drafts``), so the next step
starts where the engine counts the sequence computed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from dsinfer.base.trace import Tracer
from dsinfer.base.v4_config import V4Config
from dsinfer.model.batch import ForwardBatch
from dsinfer.model.deepseek_v4 import DeepseekV4ForCausalLM
from dsinfer.model.overlap import MicroBatch
from dsinfer.model.v4_overlap import V4MicroBatch, forward_two_v4
from dsinfer.model.v4_paged import SequenceStates
from dsinfer.model.v4_state import SequenceState


class ServedV4(nn.Module):
    def __init__(self, model: DeepseekV4ForCausalLM) -> None:
        super().__init__()
        self.model = model
        self.config: V4Config = model.config
        self.ep = model.ep  # this rank's part in an expert-parallel pool, or None
        self._streams: torch.Tensor | None = None  # the last step's final streams, with MTP

    @property
    def num_cache_layers(self) -> int:
        return self.config.num_hidden_layers

    def forward(self, token_ids: torch.Tensor, batch: ForwardBatch, states: SequenceStates) -> torch.Tensor:
        """The step's tokens (sequence after sequence, as ``batch`` says) -> final-normed hidden
        states [T, hidden]."""
        if batch.seq_keys is None:
            raise RuntimeError("DeepSeek-V4 keeps a cache per sequence: the batch must name its sequences")
        found = _states_of(batch, states)
        streams = self.model.forward_streams(token_ids, found, batch.q_lens, self._undo(batch))
        self._streams = streams if self.model.mtp else None
        hidden = self.model.finish(streams, found, batch.q_lens)
        if batch.after_layer is not None:  # every layer's pages are written: a connector may send them
            for layer in range(self.config.num_hidden_layers):
                batch.after_layer(layer)
        return hidden

    def forward_two(
        self,
        micro_batches: tuple[MicroBatch, MicroBatch],
        states: SequenceStates,
        order: str,
        *,
        tracer: Tracer | None = None,
        after_layer: Callable[[int], None] | None = None,
    ) -> None:
        """Two micro-batches interleaved (dsinfer/model/v4_overlap.py); sets their ``hidden``."""
        v4 = tuple(
            V4MicroBatch(
                mb.input_ids,
                _states_of(mb.batch, states) if mb.batch else [],
                mb.batch.q_lens if mb.batch else [],
                self._undo(mb.batch) if mb.batch else None,
            )
            for mb in micro_batches
        )
        forward_two_v4(self.model, (v4[0], v4[1]), order, tracer=tracer, after_layer=after_layer)
        for mb, done in zip(micro_batches, v4, strict=True):
            mb.hidden = done.hidden
        if self.model.mtp:  # the runner concatenates the micro-batches' rows in this order
            self._streams = torch.cat([done.streams for done in v4 if done.streams is not None])

    def _undo(self, batch: ForwardBatch) -> list[bool] | None:
        """The sequences whose step verifies a draft: their state keeps undo records (MTP)."""
        return [d > 0 for d in batch.drafts] if batch.drafts is not None and self.model.mtp else None

    def settle_drafts(self, keys: list[str], accepted: list[bool], states: SequenceStates) -> None:
        """After the target sampled: the sequences ``keys`` verified a draft, kept where
        ``accepted``, else its token is taken back out of the state."""
        for key, ok in zip(keys, accepted, strict=True):
            state = states.state_of(key)
            if not ok:
                self.model.drop_last(state)
            self.model.forget_undo(state)

    def mtp_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the MTP layer reads at each of the step's rows: the last layer's streams, flat
        ``[T, hc_mult * hidden]`` (``hidden`` is the final-normed state, not it)."""
        if self._streams is None:
            raise RuntimeError("the MTP layer reads the streams of a forward run with it")
        return self._streams.flatten(1)

    @torch.inference_mode()
    def forward_mtp(
        self,
        rows: torch.Tensor,
        next_tokens: torch.Tensor,
        batch: ForwardBatch,
        states: SequenceStates,
        last_only: bool = True,
        depth: int = 0,
    ) -> torch.Tensor:
        """The MTP layer over ``rows`` (``mtp_input`` at each sequence's valid positions, as
        ``batch`` lays them out) and the token after each -> its output streams at each sequence's
        last position ``[B, hc_mult * hidden]`` (``last_only``), else at every row."""
        assert batch.seq_keys is not None
        found = [states.state_of(key) for key in batch.seq_keys]
        starts = [kv - q for kv, q in zip(batch.kv_lens, batch.q_lens, strict=True)]
        streams = rows.view(rows.shape[0], self.config.hc_mult, self.config.hidden_size)
        out = self.model.forward_mtp(streams, next_tokens, found, starts, batch.q_lens, depth)
        if last_only:
            ends = torch.tensor(batch.q_lens, device=out.device).cumsum(0) - 1
            out = out[ends]
        return out.flatten(1)

    @torch.inference_mode()
    def compute_mtp_logits(self, mtp_out: torch.Tensor, depth: int = 0) -> torch.Tensor:
        streams = mtp_out.view(mtp_out.shape[0], self.config.hc_mult, self.config.hidden_size)
        return self.model.compute_mtp_logits(streams, depth)

    def expert_load(self) -> dict[int, list[int]]:
        """Tokens routed to each expert so far, per layer (hash-routed layers included; the MTP
        layers' after the decoder layers')."""
        layers = [*self.model.layers, *self.model.mtp]
        return {i: layer.ffn.expert_load.tolist() for i, layer in enumerate(layers)}

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def idle_forward(self, decoder_layers: bool = True) -> None:
        """A step without tokens on this rank of an expert-parallel pool: every layer's experts
        exchange nothing with the others, as the ranks with tokens expect (each MoE layer's
        dispatch and combine are collectives): the decoder layers' (unless a two-micro-batch
        schedule ran them), then the MTP layers'. Nothing to pair on one rank."""
        if self.ep is None:
            return
        weight = self.model.embed.weight
        x = torch.zeros(0, self.config.hidden_size, dtype=weight.dtype, device=weight.device)
        ids = torch.zeros(0, dtype=torch.long, device=weight.device)
        for layer in [*(self.model.layers if decoder_layers else []), *self.model.mtp]:
            layer.ffn(x, ids)


def _states_of(batch: ForwardBatch, states: SequenceStates) -> list[SequenceState]:
    """The states of the batch's sequences for this step, bound to their pages."""
    assert batch.seq_keys is not None
    found = []
    for i, (key, kv_len, q_len) in enumerate(zip(batch.seq_keys, batch.kv_lens, batch.q_lens, strict=True)):
        pages = batch.block_tables[i, : -(-kv_len // states.page_tokens)].tolist()
        found.append(states.for_step(key, kv_len - q_len, pages))
    return found
