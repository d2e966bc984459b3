"""``dsinfer generate``: one prompt, greedy, end to end."""

from __future__ import annotations

import argparse
import json

import torch

from dsinfer.base.config import PAGE_SIZE
from dsinfer.base.presets import resolve_model
from dsinfer.base.tokenizer import Tokenizer
from dsinfer.cache.latent_pool import LatentKVPool
from dsinfer.cli.errors import UsageError
from dsinfer.engine.greedy import GreedyGenerator
from dsinfer.model.loader import load_model
from dsinfer.ops import select_ops

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def run_generate(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    path, _ = resolve_model(args.model)
    tokenizer = Tokenizer.from_dir(path)
    prompt = tokenizer.encode(args.prompt)
    ops = select_ops(device)
    loaded = load_model(path, ops, device=device, dtype=dtype, load_format=args.load_format, seed=args.seed)
    config = loaded.config
    if len(prompt) + args.max_tokens > config.max_position_embeddings:
        raise UsageError(
            f"prompt ({len(prompt)} tokens) + --max-tokens {args.max_tokens} exceeds the model's "
            f"max_position_embeddings {config.max_position_embeddings}"
        )
    pool = LatentKVPool.for_model(
        config, loaded.model.num_cache_layers, -(-(len(prompt) + args.max_tokens) // PAGE_SIZE), dtype, device
    )
    generator = GreedyGenerator(loaded.model, pool, ops)
    token_ids = list(generator.generate(prompt, args.max_tokens, config.eos_token_ids))
    text = tokenizer.decode(token_ids)
    print(json.dumps({"token_ids": token_ids, "text": text}, ensure_ascii=False) if args.json else text)
    return 0
