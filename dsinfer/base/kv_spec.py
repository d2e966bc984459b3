"""The per-token layout of one layer of the paged KV cache, tensor-free.

A cache layer holds one or more per-token caches, each with its width and dtype:

- ``latent``: MLA's compressed KV, ``kv_lora_rank + qk_rope_head_dim`` values (576 for
  DeepSeek-V3), in the model's dtype (FlashMLA's layout);
- ``indexer`` (V3.2 only): the lightning indexer's key of each token, ``index_head_dim`` values
  in the model's dtype, or in FP8 as DeepSeek's release keeps it: ``index_head_dim`` e4m3 bytes
  and one fp32 scale per token, ``index_head_dim + 4`` bytes stored as uint8 and laid out per page
  as DeepGEMM's paged MQA logits kernel reads it (the page's keys, then the page's scales).

Everything that allocates, keeps or moves pages works from this spec: the pool (one tensor per
layer and component), the prefix cache and its disk tier (a page is the bytes of every layer's
components), the PD transfer (each layer's components are written together), CUDA graphs, the
memory plan and the simulator's KV accounting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dsinfer.base.config import PAGE_SIZE, ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "uint8": 1}
FP8_SCALE_BYTES = 4  # one fp32 scale per FP8 indexer key
IndexerFormat = Literal["model", "fp8"]
ComponentName = Literal["latent", "indexer"]


@dataclass(frozen=True)
class CacheComponent:
    name: ComponentName
    width: int  # elements per token
    dtype: str  # torch dtype name without "torch."

    def __post_init__(self) -> None:
        if self.width <= 0:
            raise ValueError(f"cache component {self.name}: width must be positive, got {self.width}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(
                f"cache component {self.name}: dtype {self.dtype!r} not one of {sorted(DTYPE_BYTES)}"
            )

    @property
    def bytes_per_token(self) -> int:
        return self.width * DTYPE_BYTES[self.dtype]

    def describe(self) -> str:
        return f"{self.name} {self.width} x {self.dtype}"


@dataclass(frozen=True)
class KVCacheSpec:
    """The caches of one layer, in storage order, and the tokens per page."""

    components: tuple[CacheComponent, ...]
    page_size: int = PAGE_SIZE

    def __post_init__(self) -> None:
        names = [c.name for c in self.components]
        if not names or names[0] != "latent" or len(set(names)) != len(names):
            raise ValueError(f"a cache spec starts with the latent and names each cache once, got {names}")
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")

    @classmethod
    def for_model(
        cls, config: ModelConfig, dtype: str, indexer: IndexerFormat = "model", page_size: int = PAGE_SIZE
    ) -> KVCacheSpec:
        """The spec of ``config``'s cache with values in ``dtype``; ``indexer`` "fp8" keeps V3.2's
        indexer keys as FP8 with a per-token scale (ignored for dense models)."""
        components = [CacheComponent("latent", config.kv_cache_dim, dtype)]
        if config.is_sparse:
            assert config.index_head_dim is not None
            if indexer == "fp8":
                components.append(CacheComponent("indexer", config.index_head_dim + FP8_SCALE_BYTES, "uint8"))
            else:
                components.append(CacheComponent("indexer", config.index_head_dim, dtype))
        return cls(tuple(components), page_size)

    @classmethod
    def latent(cls, width: int, dtype: str, page_size: int = PAGE_SIZE) -> KVCacheSpec:
        """A dense-attention spec: the latent only."""
        return cls((CacheComponent("latent", width, dtype),), page_size)

    def component(self, name: ComponentName) -> CacheComponent | None:
        return next((c for c in self.components if c.name == name), None)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in one layer, over every component."""
        return sum(c.bytes_per_token for c in self.components)

    @property
    def page_bytes(self) -> int:
        """Bytes one page takes in one layer."""
        return self.page_size * self.bytes_per_token

    def describe(self) -> str:
        return " + ".join(c.describe() for c in self.components)

    def signature(self) -> str:
        """A canonical text of the layout: two pools whose signatures are equal exchange pages."""
        return f"page {self.page_size}: " + ", ".join(
            f"{c.name}:{c.width}:{c.dtype}" for c in self.components
        )
