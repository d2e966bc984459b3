"""DeepSeek-V4 behind the engine's model interface (what ``ModelRunner`` calls on V3's model).

The engine schedules V4 like V3: chunked prefill, decodes batched, pages charged per 256 tokens.
Where V3 reads and writes its latent through the block table, V4 keeps each sequence's hybrid
cache (``SequenceState``: window, compressed entries, indexer keys, compressor state) in the
pool's ``SequenceStates`` under the sequence's first page, which the pool drops when that page is
freed. Served this way: one rank, colocated (no EP group, no PD transfer, no prefix cache, no
MTP, no CUDA graphs); those need V4's cache paged group by group (dsinfer/base/kv_groups.py).
"""

from __future__ import annotations

import torch
from torch import nn

from dsinfer.base.v4_config import V4Config
from dsinfer.model.batch import ForwardBatch
from dsinfer.model.deepseek_v4 import DeepseekV4ForCausalLM
from dsinfer.model.v4_state import SequenceStates


class ServedV4(nn.Module):
    ep = None  # one rank: no expert-parallel group

    def __init__(self, model: DeepseekV4ForCausalLM) -> None:
        super().__init__()
        self.model = model
        self.config: V4Config = model.config

    @property
    def num_cache_layers(self) -> int:
        return self.config.num_hidden_layers

    def forward(self, token_ids: torch.Tensor, batch: ForwardBatch, states: SequenceStates) -> torch.Tensor:
        """The step's tokens (sequence after sequence, as ``batch`` says) -> final-normed hidden
        states [T, hidden]."""
        if batch.after_layer is not None:
            raise RuntimeError("DeepSeek-V4 has no per-layer KV hook yet (PD transfer is not served)")
        keys = batch.block_tables[:, 0].tolist()
        starts = [kv - q for kv, q in zip(batch.kv_lens, batch.q_lens, strict=True)]
        seq_states = [states.for_step(k, s) for k, s in zip(keys, starts, strict=True)]
        return self.model.forward_many(token_ids, seq_states, batch.q_lens)

    def expert_load(self) -> dict[int, list[int]]:
        """Tokens routed to each expert so far, per layer (hash-routed layers included)."""
        return {i: layer.ffn.expert_load.tolist() for i, layer in enumerate(self.model.layers)}

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def idle_forward(self, decoder_layers: bool = True) -> None:
        """Nothing to pair: without an expert-parallel group an idle step does no work."""
