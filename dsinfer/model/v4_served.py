"""DeepSeek-V4 behind the engine's model interface (what ``ModelRunner`` calls on V3's model).

The engine schedules V4 like V3: chunked prefill, decodes batched, pages charged per 256 tokens.
Its compressed entries and indexer keys are written to and read from the sequence's pages; its
window rows and compressor state are the sequence's own (dsinfer/model/v4_paged.py), found by the
batch's sequence keys, with resume points at page boundaries for the prefix cache and the PD
handoff. A KV connector's per-layer hook runs once the whole forward is done (the layers' pages
are written as the model runs its sequences one by one). In an expert-parallel pool each rank
attends its own sequences and holds its expert slots (dsinfer/model/v4_moe.py); a rank without
tokens runs the layers' MoE exchanges alone (``idle_forward``). No MTP, no CUDA graphs.
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

    @property
    def num_cache_layers(self) -> int:
        return self.config.num_hidden_layers

    def forward(self, token_ids: torch.Tensor, batch: ForwardBatch, states: SequenceStates) -> torch.Tensor:
        """The step's tokens (sequence after sequence, as ``batch`` says) -> final-normed hidden
        states [T, hidden]."""
        if batch.seq_keys is None:
            raise RuntimeError("DeepSeek-V4 keeps a cache per sequence: the batch must name its sequences")
        hidden = self.model.forward_many(token_ids, _states_of(batch, states), batch.q_lens)
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
            )
            for mb in micro_batches
        )
        forward_two_v4(self.model, (v4[0], v4[1]), order, tracer=tracer, after_layer=after_layer)
        for mb, done in zip(micro_batches, v4, strict=True):
            mb.hidden = done.hidden

    def expert_load(self) -> dict[int, list[int]]:
        """Tokens routed to each expert so far, per layer (hash-routed layers included)."""
        return {i: layer.ffn.expert_load.tolist() for i, layer in enumerate(self.model.layers)}

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def idle_forward(self, decoder_layers: bool = True) -> None:
        """A step without tokens on this rank of an expert-parallel pool: every layer's experts
        exchange nothing with the others, as the ranks with tokens expect (each MoE layer's
        dispatch and combine are collectives). Nothing to pair on one rank."""
        if self.ep is None or not decoder_layers:
            return
        weight = self.model.embed.weight
        x = torch.zeros(0, self.config.hidden_size, dtype=weight.dtype, device=weight.device)
        ids = torch.zeros(0, dtype=torch.long, device=weight.device)
        for layer in self.model.layers:
            layer.ffn(x, ids)


def _states_of(batch: ForwardBatch, states: SequenceStates) -> list[SequenceState]:
    """The states of the batch's sequences for this step, bound to their pages."""
    assert batch.seq_keys is not None
    found = []
    for i, (key, kv_len, q_len) in enumerate(zip(batch.seq_keys, batch.kv_lens, batch.q_lens, strict=True)):
        pages = batch.block_tables[i, : -(-kv_len // states.page_tokens)].tolist()
        found.append(states.for_step(key, kv_len - q_len, pages))
    return found
