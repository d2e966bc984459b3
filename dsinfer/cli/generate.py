"""``dsinfer generate``: one prompt, greedy, end to end, through the offline engine."""

from __future__ import annotations

import argparse
import json

from dsinfer.base.sampling_params import SamplingParams
from dsinfer.cli.errors import UsageError
from dsinfer.engine.llm import LLM

KV_CACHE_MEMORY = "256MiB"  # one prompt needs little; the servers size the cache from free memory


def run_generate(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    llm = LLM(
        args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        kv_cache_memory=KV_CACHE_MEMORY,
        enable_prefix_caching=False,
    )
    try:
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
        output = llm.generate([args.prompt], params, use_tqdm=False)[0].outputs[0]
    except ValueError as e:
        raise UsageError(str(e)) from None
    finally:
        llm.engine.close()
    print(
        json.dumps({"token_ids": output.token_ids, "text": output.text}, ensure_ascii=False)
        if args.json
        else output.text
    )
    return 0
