"""DeepSeek-V4 assembly: embedding into ``hc_mult`` streams, decoder layers (V4 attention and MoE,
each between hyper-connections), the streams' head, final norm, lm head.

Module names follow DeepSeek's release layout (``layers.N.attn.wq_a``, ``layers.N.ffn.gate``,
``embed``, ``head``; dsinfer/model/v4_loader.py reads checkpoints onto them). Routed experts are
stacked per layer (``ffn.w13``: gate then up; ``ffn.w2``).

A forward takes the next tokens of one or more sequences, flattened sequence after sequence, and
each one's ``SequenceState`` (dsinfer/model/v4_state.py): a prompt, a chunk of it, or one decode
token each. Everything but attention runs over all the tokens at once; attention runs per
sequence over its own hybrid cache.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from dsinfer.base.v4_config import V4Config
from dsinfer.model.hyper_connection import HyperConnection, HyperHead
from dsinfer.model.layers import Embedding, Linear
from dsinfer.model.moe import ExpertParallel
from dsinfer.model.v4_attention import V4Attention
from dsinfer.model.v4_compressor import V4RMSNorm
from dsinfer.model.v4_moe import V4MoE
from dsinfer.model.v4_state import SequenceState
from dsinfer.ops import Ops


class V4DecoderLayer(nn.Module):
    def __init__(
        self, config: V4Config, ops: Ops, layer: int, ep: ExpertParallel | None = None, mxfp4: bool = False
    ) -> None:
        super().__init__()
        self.layer = layer
        self.attn = V4Attention(config, ops, layer)
        self.ffn = V4MoE(config, ops, layer, ep, mxfp4)
        self.attn_norm = V4RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn_norm = V4RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def forward(
        self,
        streams: torch.Tensor,
        token_ids: torch.Tensor,
        positions: list[torch.Tensor],
        states: list[SequenceState],
        boundaries: list[int | None],
    ) -> torch.Tensor:
        """``positions[i]``: sequence i's new tokens, the next ``len(positions[i])`` rows;
        ``boundaries[i]``: the page boundary they cross last, if any (its resume state is kept)."""
        streams = self.attention(streams, positions, states, boundaries)
        x, post, comb = self.ffn_in(streams)
        return HyperConnection.expand(streams, self.ffn(x, token_ids), post, comb)

    # The layer in stages (two micro-batches interleave them: dsinfer/model/v4_overlap.py)
    def attention(
        self,
        streams: torch.Tensor,
        positions: list[torch.Tensor],
        states: list[SequenceState],
        boundaries: list[int | None],
    ) -> torch.Tensor:
        pre, post, comb = self.attn_hc.weights(streams)
        x = self.attn_norm(HyperConnection.collapse(streams, pre))
        h = self.attn(x, positions, [state.layers[self.layer] for state in states], boundaries)
        return HyperConnection.expand(streams, h, post, comb)

    def ffn_in(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The MoE's input and the weights that put its output back into the streams."""
        pre, post, comb = self.ffn_hc.weights(streams)
        return self.ffn_norm(HyperConnection.collapse(streams, pre)), post, comb


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(
        self, config: V4Config, ops: Ops, ep: ExpertParallel | None = None, mxfp4: bool = False
    ) -> None:
        """``mxfp4``: the routed experts stay packed MXFP4 (dsinfer/model/v4_moe.py)."""
        super().__init__()
        self.config, self.ep = config, ep
        self.embed = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            V4DecoderLayer(config, ops, i, ep, mxfp4) for i in range(config.num_hidden_layers)
        )
        self.hc_head = HyperHead(config)
        self.norm = V4RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = Linear(config.hidden_size, config.vocab_size, ops)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, state: SequenceState) -> torch.Tensor:
        """One sequence's next tokens ``[T]`` -> final-normed hidden states [T, hidden]; ``state``
        takes them in."""
        return self.forward_many(token_ids, [state], [token_ids.shape[0]])

    @torch.inference_mode()
    def forward_many(
        self, token_ids: torch.Tensor, states: list[SequenceState], q_lens: list[int]
    ) -> torch.Tensor:
        """Sequence i's next ``q_lens[i]`` tokens, flattened in order into ``token_ids [T]`` ->
        final-normed hidden states [T, hidden]; each state takes its sequence's tokens in."""
        step = self.start(token_ids, states, q_lens)
        streams = step.streams
        for layer in self.layers:
            streams = layer(streams, token_ids, step.positions, states, step.boundaries)
        return self.finish(streams, states, q_lens)

    def start(self, token_ids: torch.Tensor, states: list[SequenceState], q_lens: list[int]) -> V4Step:
        """A step's positions, the page boundaries it crosses (marked on the states) and the
        embedded tokens as ``hc_mult`` streams."""
        device = token_ids.device
        positions = [
            torch.arange(state.length, state.length + n, device=device)
            for state, n in zip(states, q_lens, strict=True)
        ]
        boundaries = [_last_boundary(state, n) for state, n in zip(states, q_lens, strict=True)]
        for state, boundary in zip(states, boundaries, strict=True):
            if boundary is not None:
                state.boundary = boundary
        x = self.embed(token_ids)
        return V4Step(positions, boundaries, x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous())

    def finish(self, streams: torch.Tensor, states: list[SequenceState], q_lens: list[int]) -> torch.Tensor:
        """The last layer's streams -> final-normed hidden states; the states took the tokens in."""
        for state, n in zip(states, q_lens, strict=True):
            state.length += n
        return self.norm(self.hc_head(streams))

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()

    def new_state(self) -> SequenceState:
        return SequenceState.empty(self.config, self.embed.weight.dtype, self.embed.weight.device)


class V4Step(NamedTuple):
    positions: list[torch.Tensor]
    boundaries: list[int | None]
    streams: torch.Tensor  # [T, hc_mult, hidden]


def _last_boundary(state: SequenceState, new_tokens: int) -> int | None:
    """The last multiple of ``state.boundary_every`` in (length, length + new_tokens]."""
    if state.boundary_every is None:
        return None
    last = (state.length + new_tokens) // state.boundary_every * state.boundary_every
    return last if last > state.length else None
