"""DeepSeek-V3 assembly (V3.2's sparse attention included, behind the config): embedding, decoder layers (dense first-k, then MoE), final norm, lm_head, MTP.

Module names follow the Hugging Face checkpoint (``model.layers.N.self_attn.q_a_proj`` ...), so the
loader maps tensors one to one, except two things: routed experts are stacked per layer
(``mlp.experts.w13`` / ``w2``) and the MTP layers (checkpoint index ``num_hidden_layers + j``) live
in ``mtp_layers[j]``.

Each decoder layer is exposed in stages so that micro-batch schedules (dsinfer/model/overlap.py)
interleave two batches without another copy of the model: ``attention_in`` (input norm, MLA
projections, latent cache and indexer keys written), ``attention_out`` (core attention, o_proj, residual),
``ffn_begin`` (post-attention norm, MoE gate, dispatch posted), ``ffn_experts`` (routed experts
on the received rows, combine posted; a dense layer's MLP), ``ffn_shared`` (shared experts) and
``ffn_end`` (combined results weighted and summed, residual). ``forward`` runs them in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dsinfer.base.config import ModelConfig
from dsinfer.model.batch import ForwardBatch, LayerCache
from dsinfer.model.checkpoint import SCALE_SUFFIX
from dsinfer.model.layers import MLP, Embedding, Linear, RMSNorm
from dsinfer.model.mla import MLA, Projected
from dsinfer.model.moe import ExpertParallel, Gate, MoE, Received, RoutedWork
from dsinfer.ops import Ops
from dsinfer.parallel.ep import Pending


class MTPUnavailableError(RuntimeError):
    """MTP was asked of a model built or loaded without MTP weights."""


@dataclass
class FeedForward:
    """One micro-batch's feed-forward half of one layer while its stages run."""

    h: torch.Tensor  # post-attention-normed input [T, H]
    routed: RoutedWork | None = None  # MoE layers: the transfers in flight
    dense: torch.Tensor | None = None  # dense layers: the MLP's output
    shared: torch.Tensor | None = None  # the shared experts' output

    @property
    def dispatch(self) -> Pending[Received] | None:
        return self.routed.dispatch if self.routed is not None else None

    @property
    def combine(self) -> Pending[torch.Tensor] | None:
        return self.routed.combine if self.routed is not None else None


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        ops: Ops,
        layer_id: int,
        expert_ids: list[int] | None,
        ep: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.self_attn = MLA(config, ops)
        self.mlp: nn.Module = (
            MoE(config, ops, layer_id, expert_ids, ep)
            if config.is_moe_layer(layer_id)
            else MLP(config.hidden_size, config.intermediate_size, ops)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, ops, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, ops, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: LayerCache) -> torch.Tensor:
        return self.feed_forward(
            self.attention_out(x, self.attention_in(x, batch, kv_cache), batch, kv_cache), batch
        )

    def feed_forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        ffn = self.ffn_begin(x, batch)
        self.ffn_experts(ffn, ffn.dispatch.wait() if ffn.dispatch is not None else None)
        self.ffn_shared(ffn)
        return self.ffn_end(x, ffn, ffn.combine.wait() if ffn.combine is not None else None)

    def attention_in(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: LayerCache) -> Projected:
        """Input norm and MLA projections; the new tokens' latents (and indexer keys) are written
        to ``kv_cache``."""
        return self.self_attn.project(self.input_layernorm(x), batch, kv_cache)

    def attention_out(
        self,
        x: torch.Tensor,
        q: Projected,
        batch: ForwardBatch,
        kv_cache: LayerCache,
    ) -> torch.Tensor:
        """Core attention and output projection, added to the residual ``x``."""
        return x + self.self_attn.attend(q, batch, kv_cache)

    def ffn_begin(self, x: torch.Tensor, batch: ForwardBatch | None = None) -> FeedForward:
        """Post-attention norm and, in MoE layers, the gate and the dispatch. ``batch`` (when
        given) says whether the routed experts take the graph-safe masked layout."""
        h = self.post_attention_layernorm(x)
        if not isinstance(self.mlp, MoE):
            return FeedForward(h)
        if batch is not None and batch.masked_moe:
            return FeedForward(h, self.mlp.begin(h, token_mask=batch.token_mask, masked=True))
        return FeedForward(h, self.mlp.begin(h))

    def ffn_experts(self, ffn: FeedForward, received: Received | None) -> None:
        if ffn.routed is None:
            ffn.dense = self.mlp(ffn.h)
        else:
            assert received is not None and isinstance(self.mlp, MoE)
            self.mlp.run_experts(ffn.routed, received)

    def ffn_shared(self, ffn: FeedForward) -> None:
        if isinstance(self.mlp, MoE):
            ffn.shared = self.mlp.shared(ffn.h)

    def ffn_end(self, x: torch.Tensor, ffn: FeedForward, combined: torch.Tensor | None) -> torch.Tensor:
        if ffn.routed is None:
            assert ffn.dense is not None
            return x + ffn.dense
        assert combined is not None and isinstance(self.mlp, MoE)
        y = self.mlp.routed_sum(ffn.routed, combined)
        return x + (y if ffn.shared is None else y + ffn.shared)


class SharedHead(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, ops, config.rms_norm_eps)
        self.head = Linear(config.hidden_size, config.vocab_size, ops)


class MTPLayer(DecoderLayer):
    """Multi-token prediction: draft logits for position t+2 from (hidden of t, token t+1).

    x = eh_proj(concat(enorm(embed(next_token)), hnorm(hidden))), then one MoE decoder layer with
    its own latent cache, then shared_head.norm and shared_head.head. ``hidden`` is the main
    model's final-normed output at the same position.
    """

    def __init__(
        self,
        config: ModelConfig,
        ops: Ops,
        layer_id: int,
        expert_ids: list[int] | None,
        ep: ExpertParallel | None = None,
    ) -> None:
        super().__init__(config, ops, layer_id, expert_ids, ep)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.enorm = RMSNorm(config.hidden_size, ops, config.rms_norm_eps)
        self.hnorm = RMSNorm(config.hidden_size, ops, config.rms_norm_eps)
        self.eh_proj = Linear(2 * config.hidden_size, config.hidden_size, ops)
        self.shared_head = SharedHead(config, ops)
        self.draft_dtype: torch.dtype | None = None  # set by cast(): the layer runs in it

    def cast(self, dtype: torch.dtype, draft_dtype: torch.dtype) -> None:
        """Before post_load: the layer's weights of ``dtype`` take ``draft_dtype``, and it runs
        in it (its input cast, its latents stored in the cache's dtype). The router keeps its
        weights: it scores in float32 whatever the input; FP8 weights and their scales stay."""
        for module in self.modules():
            if isinstance(module, Gate):
                continue
            for name, param in list(module._parameters.items()):
                if param is not None and param.dtype == dtype and not name.endswith(SCALE_SUFFIX):
                    module._parameters[name] = nn.Parameter(param.to(draft_dtype), requires_grad=False)
        self.draft_dtype = draft_dtype

    def forward_mtp(
        self,
        hidden: torch.Tensor,
        next_tokens: torch.Tensor,
        batch: ForwardBatch,
        kv_cache: LayerCache,
        last_only: bool = False,
        last: tuple[torch.Tensor, ForwardBatch] | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, H], or with ``last_only`` [B, H] of each sequence's last position: a
        draft reads no other, so the rest only write their latent KV (no attention, no FFN).
        ``last`` gives those positions' rows and their batch (else derived from ``batch`` on the
        host; a CUDA graph passes them over its static buffers)."""
        if self.draft_dtype is not None:
            hidden = hidden.to(self.draft_dtype)
        x = torch.cat([self.enorm(self.embed_tokens(next_tokens)), self.hnorm(hidden)], dim=-1)
        x = self.eh_proj(x)
        if not last_only:
            return super().forward(x, batch, kv_cache)
        q = self.attention_in(x, batch, kv_cache)
        if last is None and batch.num_absorbed == batch.num_tokens:
            # one new token per sequence, all decodes (a chained draft): every row is a last one
            return self.feed_forward(self.attention_out(x, q, batch, kv_cache), batch)
        if last is None:
            rows = batch.last_token_indices()
            last = rows, batch.last_tokens(rows)
        rows, tail = last
        return self.feed_forward(self.attention_out(x[rows], q.take(rows), tail, kv_cache), tail)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head_states(hidden)[1]

    def head_states(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (shared_head.norm of ``hidden``, draft logits fp32 from it)."""
        normed = self.shared_head.norm(hidden)
        return normed, self.shared_head.head(normed).float()


class Backbone(nn.Module):
    def __init__(
        self, config: ModelConfig, ops: Ops, expert_ids: list[int] | None, ep: ExpertParallel | None
    ) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, ops, i, expert_ids, ep) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, ops, config.rms_norm_eps)


class DeepseekV3ForCausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        ops: Ops,
        *,
        num_mtp_layers: int = 0,
        expert_ids: list[int] | None = None,
        ep: ExpertParallel | None = None,
    ) -> None:
        super().__init__()
        if num_mtp_layers > config.num_nextn_predict_layers:
            raise MTPUnavailableError(
                f"{num_mtp_layers} MTP layers asked for, the config has num_nextn_predict_layers="
                f"{config.num_nextn_predict_layers}"
            )
        self.config = config
        self.model = Backbone(config, ops, expert_ids, ep)
        self.ep = ep
        self.lm_head = Linear(config.hidden_size, config.vocab_size, ops)
        first_mtp = config.num_hidden_layers
        self.mtp_layers = nn.ModuleList(
            MTPLayer(config, ops, first_mtp + j, expert_ids, ep) for j in range(num_mtp_layers)
        )

    @property
    def num_cache_layers(self) -> int:
        """Latent caches needed: one per decoder layer and one per MTP layer."""
        return self.config.num_hidden_layers + len(self.mtp_layers)

    def post_load(self, dtype: torch.dtype, draft_dtype: torch.dtype | None = None) -> None:
        """Derive what the loaded weights imply (stacked and absorbed MLA weights, stacked MLP
        gate and up rows, packed GEMM weights). ``draft_dtype``: the MTP layers' weights of
        ``dtype`` take that dtype first (they draft in it)."""
        if draft_dtype is not None and draft_dtype != dtype:
            for layer in self.mtp_layers:
                layer.cast(dtype, draft_dtype)
        drafting = {id(layer.self_attn): layer.draft_dtype for layer in self.mtp_layers}
        for module in list(self.modules()):
            if isinstance(module, MLA):
                module.stack_a_proj()
                module.prepare_absorbed(drafting.get(id(module)) or dtype)
            elif isinstance(module, MLP):
                module.stack_gate_up()
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, batch: ForwardBatch, kv_caches: list[LayerCache]
    ) -> torch.Tensor:
        """input_ids [T] -> final-normed hidden states [T, H]; writes each layer's latent cache."""
        x = self.model.embed_tokens(input_ids)
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=False)):
            x = layer(x, batch, kv_cache)  # (MTP caches follow the decoder layers' in kv_caches)
            if batch.after_layer is not None:
                batch.after_layer(i)
        return self.model.norm(x)

    @torch.inference_mode()
    def idle_forward(self, *, decoder_layers: bool = True) -> None:
        """A forward with no tokens of its own: under expert parallelism this rank still joins
        every MoE layer's dispatch and combine (and computes what others send its experts), in
        the order a real forward would - decoder layers (unless ``decoder_layers`` is False: a
        two-micro-batch schedule ran them), then the MTP layers."""
        if self.ep is None:
            return
        empty = self.model.embed_tokens(torch.empty(0, dtype=torch.int64, device=self.lm_head.weight.device))
        layers = [*self.model.layers] if decoder_layers else []
        for layer in [*layers, *self.mtp_layers]:
            if isinstance(layer.mlp, MoE):
                layer.mlp(empty)

    def expert_load(self) -> dict[int, list[int]]:
        """Tokens routed to each logical expert so far, per MoE layer id (this rank's tokens)."""
        return {
            layer.layer_id: layer.mlp.expert_load.tolist()
            for layer in [*self.model.layers, *self.mtp_layers]
            if isinstance(layer.mlp, MoE)
        }

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @torch.inference_mode()
    def forward_mtp(
        self,
        hidden: torch.Tensor,
        next_tokens: torch.Tensor,
        batch: ForwardBatch,
        kv_caches: list[LayerCache],
        depth: int = 0,
        last_only: bool = False,
        last: tuple[torch.Tensor, ForwardBatch] | None = None,
    ) -> torch.Tensor:
        """MTP module ``depth`` over (hidden of position t, token t+1) -> its hidden states [T, H]
        (``last_only``: [B, H], each sequence's last position, ``last`` as MTPLayer.forward_mtp
        takes it; every position's KV is written)."""
        layer = self._mtp_layer(depth)
        index = self.config.num_hidden_layers + depth
        out = layer.forward_mtp(hidden, next_tokens, batch, kv_caches[index], last_only, last)
        if batch.after_layer is not None:
            batch.after_layer(index)
        return out

    @torch.inference_mode()
    def mtp_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the MTP layer reads at each of a step's rows: the final-normed hidden state."""
        return hidden

    def compute_mtp_logits(self, mtp_hidden: torch.Tensor, depth: int = 0) -> torch.Tensor:
        """Draft logits fp32 [T, V] for position t+2."""
        return self._mtp_layer(depth).logits(mtp_hidden)

    @torch.inference_mode()
    def mtp_head(self, mtp_hidden: torch.Tensor, depth: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (the MTP layer's final-normed hidden states [T, H], draft logits fp32 [T, V]): a chained
        draft's layer reads the normed states where the first reads the target's (``mtp_input``)."""
        return self._mtp_layer(depth).head_states(mtp_hidden)

    def _mtp_layer(self, depth: int) -> MTPLayer:
        if depth >= len(self.mtp_layers):
            raise MTPUnavailableError(
                f"MTP depth {depth} is not loaded (model has {len(self.mtp_layers)} MTP layers; the checkpoint "
                f"may lack model.layers.{self.config.num_hidden_layers}.* tensors)"
            )
        return self.mtp_layers[depth]
