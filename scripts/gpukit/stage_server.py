"""Stage ``server``: ``dsinfer serve`` all-in-one (gateway, one prefill and one decode pool, KV over
NIXL) with both pools' ranks on the one GPU (each with its own KV budget), started and stopped as
the end-to-end tests do (harness/server.py); greedy completions through the official
``openai`` client must give the offline engine's tokens for the same prompts and settings. Also
reported: time to healthy and the completions' wall time."""

from __future__ import annotations

import time
from typing import Any

from .common import StageContext, StageResult

PROMPTS = ("Hello, DeepSeek", "The capital of France is", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16")
MAX_TOKENS = 16


def _token_ids(choice: Any) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]


def run(ctx: StageContext, result: StageResult) -> None:

    from dsinfer import LLM, SamplingParams
    from harness.server import serve

    engine_flags = [
        "--device",
        ctx.device,
        "--kv-cache-memory",
        "64MiB",
        "--max-num-seqs",
        "8",
        "--model",
        "tiny",
    ]
    # float32: the project's token-equality policy. In bfloat16 a server answering one request at a
    # time and an offline batch of three run different GEMM tiles, and a random model's near-flat
    # logits flip (the first GPU run: 1/3 prompts equal in bfloat16).
    engine_flags += ["--dtype", "float32"]
    offline = LLM(
        "tiny",
        device=ctx.device,
        kv_cache_memory="64MiB",
        max_num_seqs=8,
        dtype="float32",
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in offline.generate(list(PROMPTS), params, use_tqdm=False)]
    offline.engine.close()
    start = time.monotonic()
    with serve(engine_flags, ctx.out, startup_timeout=ctx.budget_s * 0.6) as server:
        result.figures["seconds_to_healthy"] = round(time.monotonic() - start, 1)
        client = server.openai_client()
        model = client.models.list().data[0].id
        start = time.monotonic()
        got = []
        for prompt in PROMPTS:
            completion = client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                logprobs=1,
                extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
            )
            got.append(_token_ids(completion.choices[0]))
        result.figures["completions_s"] = round(time.monotonic() - start, 2)
        result.figures["transfer_lines"] = [
            line for line in server.metrics().splitlines() if "transfer" in line and not line.startswith("#")
        ][:6]
    mismatched = [i for i, (a, b) in enumerate(zip(expected, got, strict=True)) if a != b]
    result.check(
        "server tokens = offline engine tokens",
        not mismatched,
        "; ".join(f"prompt {i}: offline {expected[i]}, server {got[i]}" for i in mismatched),
    )
    result.summary = (
        f"PD all-in-one on {ctx.device}: healthy in {result.figures['seconds_to_healthy']} s, "
        f"{len(PROMPTS) - len(mismatched)}/{len(PROMPTS)} completions equal to the offline engine"
    )
