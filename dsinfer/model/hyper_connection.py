"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): the residual is ``hc_mult`` streams.

Before a block, one projection of the RMS-normed streams (float32 parameters) gives three weights:
``pre`` collapses the streams into the block's input, ``post`` spreads the block's output back over
them, and ``comb`` (made doubly stochastic by Sinkhorn iterations) mixes the incoming streams into
the outgoing ones: ``out_k = post_k * block(sum_j pre_j x_j) + sum_j comb_jk x_j``. A final head
collapses the streams once more before the last norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsinfer.base.v4_config import V4Config


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


class HyperConnection(nn.Module):
    def __init__(self, config: V4Config) -> None:
        super().__init__()
        self.streams, self.iters = config.hc_mult, config.hc_sinkhorn_iters
        self.hc_eps, self.norm_eps = config.hc_eps, config.rms_norm_eps
        n = config.hc_mult
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * config.hidden_size), requires_grad=False)
        self.base = nn.Parameter(torch.zeros((2 + n) * n), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(3), requires_grad=False)

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams [T, n, hidden]`` -> (pre [T, n], post [T, n], comb [T, n, n]) in float32."""
        n = self.streams
        mixes = F.linear(_unit_rms(streams.flatten(1).float(), self.norm_eps), self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        return pre, post, comb

    @staticmethod
    def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)

    @staticmethod
    def expand(
        streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """The next streams: ``post`` spreads the block's output, ``comb`` mixes the old streams."""
        dtype = streams.dtype
        mixed = torch.einsum("tjk,tjd->tkd", comb.to(dtype), streams)
        return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(1) + mixed


class HyperHead(nn.Module):
    def __init__(self, config: V4Config) -> None:
        super().__init__()
        self.eps, self.norm_eps = config.hc_eps, config.rms_norm_eps
        n = config.hc_mult
        self.fn = nn.Parameter(torch.zeros(n, n * config.hidden_size), requires_grad=False)
        self.base = nn.Parameter(torch.zeros(n), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(_unit_rms(streams.flatten(1).float(), self.norm_eps), self.fn.float())
        pre = torch.sigmoid(mixes * self.scale.float() + self.base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
