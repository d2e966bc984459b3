"""DeepSeek-V4's MTP layer: the release's ``mtp.N`` block, one more decoder layer that predicts the
token after the next.

As DeepSeek's reference code builds it (vLLM and SGLang load it the same way): a V4 decoder layer
at index ``num_hidden_layers + N`` (its attention over its window only, ``compress_ratios``' extra
0; its MoE routed by its own router, no hash table), fed the target's last residual streams
``[T, hc_mult, hidden]`` (before the target's stream head) and the embedding of the token after
each position: ``h_proj(hnorm(streams)) + e_proj(enorm(embed(token)))``, ``h_proj`` on every
stream, the token's projection added to each. Its output streams go through its own stream head
(``hc_head``) and norm to the target's lm head. The embedding and the head are the target's.
"""

from __future__ import annotations

import torch

from dsinfer.base.v4_config import V4Config
from dsinfer.model.hyper_connection import HyperHead
from dsinfer.model.layers import Linear
from dsinfer.model.moe import ExpertParallel
from dsinfer.model.v4_compressor import V4RMSNorm
from dsinfer.model.v4_layer import V4DecoderLayer
from dsinfer.ops import Ops


class V4MTPLayer(V4DecoderLayer):
    def __init__(
        self, config: V4Config, ops: Ops, layer: int, ep: ExpertParallel | None = None, mxfp4: bool = False
    ) -> None:
        super().__init__(config, ops, layer, ep, mxfp4)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.e_proj = Linear(hidden, hidden, ops)
        self.h_proj = Linear(hidden, hidden, ops)
        self.enorm = V4RMSNorm(hidden, eps)
        self.hnorm = V4RMSNorm(hidden, eps)
        self.norm = V4RMSNorm(hidden, eps)
        self.hc_head = HyperHead(config)

    def inputs(self, streams: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """The target's streams ``[T, hc, hidden]`` at each position and the embedding of the token
        after it ``[T, hidden]`` -> this layer's input streams."""
        tokens, hc, hidden = streams.shape
        h = self.h_proj(self.hnorm(streams).reshape(tokens * hc, hidden)).view(tokens, hc, hidden)
        return h + self.e_proj(self.enorm(embedded)).unsqueeze(1)

    def hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """Output streams -> the final-normed hidden state the lm head reads."""
        return self.norm(self.hc_head(streams))
