"""One DeepSeek-V4 decoder layer: V4 attention and MoE, each between hyper-connections (mHC)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from dsinfer.base.v4_config import V4Config
from dsinfer.model.hyper_connection import HyperConnection
from dsinfer.model.moe import ExpertParallel
from dsinfer.model.v4_attention import V4Attention
from dsinfer.model.v4_compressor import V4RMSNorm
from dsinfer.model.v4_moe import V4MoE
from dsinfer.model.v4_state import SequenceState
from dsinfer.ops import Ops


class V4Step(NamedTuple):
    """A step's sequences: each one's new tokens' positions, the page boundary they cross last
    (if any: its resume state is kept), and the streams entering a layer ``[T, hc_mult, hidden]``."""

    positions: list[torch.Tensor]
    boundaries: list[int | None]
    streams: torch.Tensor


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
        step: V4Step,
        states: list[SequenceState],
        undo: list[bool] | None = None,
    ) -> torch.Tensor:
        """``step.positions[i]``: sequence i's new tokens, the next ``len(positions[i])`` rows;
        ``undo[i]``: its state keeps what taking its last tokens back needs (``V4Attention.rewind``)."""
        streams = self.attention(streams, step, states, undo)
        x, post, comb = self.ffn_in(streams)
        return HyperConnection.expand(streams, self.ffn(x, token_ids), post, comb)

    # The layer in stages (two micro-batches interleave them: dsinfer/model/v4_overlap.py)
    def attention(
        self, streams: torch.Tensor, step: V4Step, states: list[SequenceState], undo: list[bool] | None = None
    ) -> torch.Tensor:
        pre, post, comb = self.attn_hc.weights(streams)
        x = self.attn_norm(HyperConnection.collapse(streams, pre))
        layer_states = [state.layers[self.layer] for state in states]
        h = self.attn(x, step.positions, layer_states, step.boundaries, undo)
        return HyperConnection.expand(streams, h, post, comb)

    def ffn_in(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The MoE's input and the weights that put its output back into the streams."""
        pre, post, comb = self.ffn_hc.weights(streams)
        return self.ffn_norm(HyperConnection.collapse(streams, pre)), post, comb
