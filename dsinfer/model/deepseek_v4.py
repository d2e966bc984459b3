"""DeepSeek-V4 assembly: embedding into ``hc_mult`` streams, decoder layers (V4 attention and MoE,
each between hyper-connections), the streams' head, final norm, lm head.

Module names follow DeepSeek's release layout (``layers.N.attn.wq_a``, ``layers.N.ffn.gate``,
``embed``, ``head``; dsinfer/model/v4_loader.py reads checkpoints onto them). Routed experts are
stacked per layer (``ffn.w13``: gate then up; ``ffn.w2``).

A forward takes the next tokens of one or more sequences, flattened sequence after sequence, and
each one's ``SequenceState`` (dsinfer/model/v4_state.py): a prompt, a chunk of it, or one decode
token each. Everything but attention runs over all the tokens at once; attention runs per
sequence over its own hybrid cache.

With ``num_mtp_layers`` the release's MTP layers (``mtp.N``, dsinfer/model/v4_mtp.py) follow, their
windows after the decoder layers' states. A step that verifies an MTP draft keeps an undo record
(``undo``) so that a rejected draft's token can be taken back out of the state (``drop_last``).
"""

from __future__ import annotations

import torch
from torch import nn

from dsinfer.base.v4_config import V4Config
from dsinfer.model.hyper_connection import HyperHead
from dsinfer.model.layers import Embedding, Linear
from dsinfer.model.moe import ExpertParallel
from dsinfer.model.v4_compressor import V4RMSNorm
from dsinfer.model.v4_layer import V4DecoderLayer, V4Step
from dsinfer.model.v4_mtp import V4MTPLayer
from dsinfer.model.v4_state import SequenceState
from dsinfer.ops import Ops

__all__ = ["DeepseekV4ForCausalLM", "V4DecoderLayer", "V4Step"]


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(
        self,
        config: V4Config,
        ops: Ops,
        ep: ExpertParallel | None = None,
        mxfp4: bool = False,
        num_mtp_layers: int = 0,
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
        first = config.num_hidden_layers
        self.mtp = nn.ModuleList(V4MTPLayer(config, ops, first + j, ep, mxfp4) for j in range(num_mtp_layers))

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
        return self.finish(self.forward_streams(token_ids, states, q_lens), states, q_lens)

    @torch.inference_mode()
    def forward_streams(
        self,
        token_ids: torch.Tensor,
        states: list[SequenceState],
        q_lens: list[int],
        undo: list[bool] | None = None,
    ) -> torch.Tensor:
        """As :meth:`forward_many`, up to the last layer's streams ``[T, hc_mult, hidden]`` (what
        the MTP layer reads); :meth:`finish` ends the step. ``undo[i]``: sequence i's step may be
        taken back in part (:meth:`drop_last`)."""
        step = self.start(token_ids, states, q_lens)
        streams = step.streams
        for layer in self.layers:
            streams = layer(streams, token_ids, step, states, undo)
        return streams

    def drop_last(self, state: SequenceState, count: int = 1) -> None:
        """Take the last ``count`` tokens of the step that kept undo records back out of ``state``
        (a rejected MTP draft); a page boundary past them is crossed again later."""
        for layer in self.layers:  # the MTP layers' windows only ever take accepted tokens
            layer.attn.rewind(state.layers[layer.layer], count)
        state.length -= count
        if state.boundary is not None and state.boundary > state.length:
            state.boundary = None

    def forget_undo(self, state: SequenceState) -> None:
        for layer_state in state.layers:
            layer_state.undo = None

    @torch.inference_mode()
    def forward_mtp(
        self,
        streams: torch.Tensor,
        next_tokens: torch.Tensor,
        states: list[SequenceState],
        starts: list[int],
        q_lens: list[int],
        depth: int = 0,
    ) -> torch.Tensor:
        """MTP layer ``depth`` over the target's streams at sequence i's positions ``[starts[i],
        starts[i] + q_lens[i])`` and the token after each -> its output streams; its window (in the
        states, after the decoder layers') takes them in. It crosses the page boundary the step
        marked on a state when that lies among its positions."""
        layer = self.mtp[depth]
        device = next_tokens.device
        positions = [torch.arange(a, a + n, device=device) for a, n in zip(starts, q_lens, strict=True)]
        boundaries = [
            s.boundary if s.boundary is not None and a < s.boundary <= a + n else None
            for s, a, n in zip(states, starts, q_lens, strict=True)
        ]
        x = layer.inputs(streams, self.embed(next_tokens))
        return layer(x, next_tokens, V4Step(positions, boundaries, x), states)

    @torch.inference_mode()
    def compute_mtp_logits(self, streams: torch.Tensor, depth: int = 0) -> torch.Tensor:
        """MTP output streams ``[B, hc_mult, hidden]`` -> the draft's logits."""
        return self.head(self.mtp[depth].hidden(streams)).float()

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
        weight = self.embed.weight
        return SequenceState.empty(self.config, weight.dtype, weight.device, len(self.mtp))


def _last_boundary(state: SequenceState, new_tokens: int) -> int | None:
    """The last multiple of ``state.boundary_every`` in (length, length + new_tokens]."""
    if state.boundary_every is None:
        return None
    last = (state.length + new_tokens) // state.boundary_every * state.boundary_every
    return last if last > state.length else None
