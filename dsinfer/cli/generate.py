"""``dsinfer generate``: one prompt, greedy, end to end, through the offline engine."""

from __future__ import annotations

import argparse
import json
import sys

from dsinfer.base.sampling_params import SamplingParams
from dsinfer.cli.engine_args import engine_args_from
from dsinfer.cli.errors import UsageError
from dsinfer.engine.args import parse_size
from dsinfer.engine.llm import LLM

KV_CACHE_MEMORY = "256MiB"  # default here: one prompt needs little (servers use a fraction of free memory)


def run_generate(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    engine_args = engine_args_from(args)
    if engine_args.kv_cache_memory is None and engine_args.kv_cache_memory_fraction is None:
        engine_args = engine_args.model_copy(update={"kv_cache_memory": parse_size(KV_CACHE_MEMORY)})
    llm = LLM.from_engine_args(engine_args)
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
    if output.finish_reason == "length":
        print(
            f"dsinfer: the output stopped at --max-tokens {args.max_tokens} (finish_reason length)",
            file=sys.stderr,
        )
    return 0
