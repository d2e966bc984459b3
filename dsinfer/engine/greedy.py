"""Greedy generation of one prompt over the paged latent cache: prefill through the decompressed
MLA path, then one token per step through the absorbed path. The batched engine builds on the
same model and cache interfaces."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from dsinfer.cache.latent_pool import LatentKVPool
from dsinfer.model.batch import ForwardBatch
from dsinfer.model.deepseek_v3 import DeepseekV3ForCausalLM
from dsinfer.ops import Ops, SamplingTensors


class GreedyGenerator:
    def __init__(self, model: DeepseekV3ForCausalLM, pool: LatentKVPool, ops: Ops) -> None:
        self.model, self.pool, self.ops = model, pool, ops
        self.device = pool.caches[0].device

    def generate(self, prompt: list[int], max_tokens: int, eos_ids: tuple[int, ...] = ()) -> Iterator[int]:
        """Yields generated token ids; stops after an EOS id (yielded) or ``max_tokens``."""
        if not prompt:
            raise ValueError("the prompt is empty")
        if max_tokens <= 0:
            return
        pages = self.pool.allocator.allocate(self.pool.pages_for(len(prompt) + max_tokens))
        try:
            table = self.pool.block_table([pages]).to(self.device)
            tokens = torch.tensor(prompt, dtype=torch.int64, device=self.device)
            start, absorbed = 0, 0
            for _ in range(max_tokens):
                end = start + tokens.shape[0]
                batch = ForwardBatch(
                    positions=torch.arange(start, end, device=self.device),
                    slot_mapping=self.pool.slots(pages, start, end).to(self.device),
                    block_tables=table,
                    q_lens=[end - start],
                    kv_lens=[end],
                    num_absorbed=absorbed,
                )
                hidden = self.model(tokens, batch, self.pool.caches)
                logits = self.model.compute_logits(hidden[-1:])
                token = int(self.ops.sample(logits, SamplingTensors.greedy(1, device=self.device))[0])
                yield token
                if token in eos_ids:
                    return
                tokens = torch.tensor([token], dtype=torch.int64, device=self.device)
                start, absorbed = end, 1
        finally:
            self.pool.allocator.free(pages)
