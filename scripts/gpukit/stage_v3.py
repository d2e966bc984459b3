"""Stage ``v3-engine``: a reduced-depth, full-width DeepSeek-V3 (DeepSeek-V3's config with 4 decoder
layers, 1 dense and 3 MoE with 256 experts; FP8 block-scaled dummy weights drawn on the GPU, no MTP)
through the offline engine: a batch of prompts prefilled in chunks, then decoded step by step
(CUDA graphs on). Figures: the model's load time, prefill tokens/s, decode step times (median,
min, max) and tokens/s. Under ``--cpu-smoke``: the tiny preset's config with 2 layers, on the CPU."""

from __future__ import annotations

import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from .common import ROOT, StageContext, StageResult

V3_CONFIG = ROOT / "configs" / "models" / "deepseek-v3" / "config.json"
TINY = ROOT / "configs" / "models" / "tiny"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def reduced_checkpoint(directory: Path, config: Path, layers: int, dense: int) -> Path:
    """A weightless checkpoint directory: ``config`` cut to ``layers`` (``dense`` of them dense, no
    MTP) and the tiny preset's tokenizer (its ids are below any vocabulary here)."""
    directory.mkdir(parents=True, exist_ok=True)
    data = json.loads(config.read_text())
    data.update(num_hidden_layers=layers, first_k_dense_replace=dense, num_nextn_predict_layers=0)
    (directory / "config.json").write_text(json.dumps(data))
    for name in TOKENIZER_FILES:
        if (TINY / name).is_file():
            shutil.copy(TINY / name, directory / name)
    return directory


def _prompts(vocab: int, batch: int, prompt_len: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(0)
    return [torch.randint(2, min(vocab, 4096), (prompt_len,), generator=gen).tolist() for _ in range(batch)]


def _round(
    engine: Any, tag: str, prompts: list[list[int]], params: Any, device: str, deadline: float
) -> tuple[float, list[float], bool]:
    """Prefill ``prompts`` and decode them to the end: (prefill seconds, decode step ms, finished)."""
    import torch

    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    started: set[str] = set()
    prefill_s, decode_ms = 0.0, []
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        t0 = time.perf_counter()
        updates = engine.step_updates()
        if device == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if len(started) < len(prompts):
            prefill_s += dt
            started.update(u.request_id for u in updates if u.new_token_ids)
        else:
            decode_ms.append(dt * 1e3)
    return prefill_s, decode_ms, not engine.has_unfinished_requests()


def run(ctx: StageContext, result: StageResult) -> None:
    from dsinfer import SamplingParams
    from dsinfer.engine.args import EngineArgs
    from dsinfer.engine.engine import LLMEngine

    smoke = ctx.cpu_smoke
    config = TINY / "config.json" if smoke else V3_CONFIG
    layers, batch, prompt_len, new_tokens = (2, 4, 48, 4) if smoke else (4, 64, 1024, 32)
    path = reduced_checkpoint(ctx.out / "ckpt", config, layers, 1)
    args = EngineArgs(
        model=str(path),
        load_format="dummy",
        device=ctx.device,
        dtype="float32" if smoke else "bfloat16",
        max_num_seqs=batch,
        max_num_batched_tokens=prompt_len * 8 if not smoke else 64,
        max_model_len=prompt_len + new_tokens + 8,
        kv_cache_memory="64MiB" if smoke else None,
        kv_cache_memory_fraction=None if smoke else 0.25,  # of the memory the weights leave free
        enable_prefix_caching=False,
    )
    start = time.monotonic()
    engine = LLMEngine(args)
    result.figures["load_s"] = round(time.monotonic() - start, 1)
    result.figures["backends"] = dict(engine.ops.backends)
    result.figures["cuda_graphs"] = engine.runner.decode_graphs is not None
    prompts = _prompts(engine.config.vocab_size, batch, prompt_len)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    deadline = ctx.deadline()
    # Round 1 pays for Triton's compilation of every kernel at these shapes (H100 run 6 of
    # 2026-11-26: 8,201 tok/s of prefill cold, 30,376 warm); round 2, the same batch, is the one reported.
    first = _round(engine, "warm-up", prompts, params, ctx.device, deadline)
    prefill_s, decode_ms, finished = _round(engine, "timed", prompts, params, ctx.device, deadline)
    finished = finished and first[2]
    engine.close()
    result.figures["first_round_prefill_tokens_per_s"] = (
        round(batch * prompt_len / first[0]) if first[0] else None
    )
    f = result.figures
    f["batch"], f["prompt_tokens"], f["new_tokens"], f["layers"] = batch, prompt_len, new_tokens, layers
    f["prefill_s"] = round(prefill_s, 3)
    f["prefill_tokens_per_s"] = round(batch * prompt_len / prefill_s) if prefill_s else None
    if decode_ms:
        median = statistics.median(decode_ms)
        f["decode_step_ms"] = {
            "median": round(median, 2),
            "min": round(min(decode_ms), 2),
            "max": round(max(decode_ms), 2),
        }
        f["decode_tokens_per_s"] = round(batch / median * 1e3)
    result.check("every request finished within the stage's time", finished)
    result.check("decode steps ran", bool(decode_ms))
    if not smoke:
        result.check("decode steps captured as CUDA graphs", bool(f["cuda_graphs"]))
    result.summary = (
        f"{layers} layers, batch {batch} x {prompt_len} prompt tokens: prefill {f['prefill_tokens_per_s']} tok/s; "
        f"decode step {f.get('decode_step_ms', {}).get('median')} ms ({f.get('decode_tokens_per_s')} tok/s)"
    )
