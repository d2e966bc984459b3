"""Write the tiny DeepSeek-V3 checkpoint the offline throughput benchmark runs on.

The sizes are those of dsinfer's built-in `tiny` preset (configs/models/tiny/config.json): 4 layers,
hidden 256, 16 routed experts top-4, kv_lora_rank 512 + qk_rope_head_dim 64, vocab 4096 — the only
MLA sizes vLLM's CPU backends accept. The weights are random (fixed seed) and come from
transformers' `DeepseekV3ForCausalLM`, saved with `save_pretrained` (per-expert tensor names, no MTP
layer), so every engine reads the very same safetensors files. `topk_method: noaux_tc` and
`scoring_func: sigmoid` are written into config.json (vLLM's config parsing needs them), and the
tokenizer files of the preset are copied beside the weights.

Run with dsinfer's virtualenv (it has transformers):

    /work/venv/bin/python benchmarks/make_bench_checkpoint.py --out /work/bench-scratch/ckpt/tiny-f32
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

REPO_ROOT = Path(__file__).resolve().parents[1]
PRESET_DIR = REPO_ROOT / "configs" / "models" / "tiny"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# Keys vLLM (and dsinfer) read from config.json that transformers may drop or rename on save.
FORCED_KEYS: dict[str, Any] = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def preset_config() -> dict[str, Any]:
    """The tiny preset's config.json, without the MTP layer (transformers saves none)."""
    cfg = json.loads((PRESET_DIR / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 0
    return cfg


def build_model(cfg: dict[str, Any], seed: int) -> DeepseekV3ForCausalLM:
    """A random DeepseekV3ForCausalLM in float32.

    Norm weights are drawn as 1 + 0.1 * randn and the router's e_score_correction_bias as
    0.01 * randn, so that an engine ignoring either one gives different tokens.
    """
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, module in model.named_modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.copy_(1.0 + 0.1 * torch.randn(module.weight.shape, generator=gen))
            if name.endswith("mlp.gate") and hasattr(module, "e_score_correction_bias"):
                bias = module.e_score_correction_bias
                bias.copy_(0.01 * torch.randn(bias.shape, generator=gen))
    return model


def write_checkpoint(out_dir: Path, seed: int = 0, dtype: str = "float32") -> Path:
    """Build the model, save it in `dtype` to `out_dir` and patch config.json. Returns out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = preset_config()
    model = build_model(cfg, seed)
    if dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    model.save_pretrained(out_dir, max_shard_size="100GB")

    config_path = out_dir / "config.json"
    saved = json.loads(config_path.read_text())
    saved.update(FORCED_KEYS)
    saved["num_nextn_predict_layers"] = 0
    saved["dtype"] = dtype
    saved["torch_dtype"] = dtype
    saved["dsinfer_bench"] = {"seed": seed, "preset": "tiny", "dtype": dtype}
    config_path.write_text(json.dumps(saved, indent=2) + "\n")

    for fname in TOKENIZER_FILES:
        if (PRESET_DIR / fname).exists():
            shutil.copy(PRESET_DIR / fname, out_dir / fname)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/work/bench-scratch/ckpt/tiny-f32"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    out = write_checkpoint(args.out, seed=args.seed, dtype=args.dtype)
    n_params = sum(t.numel() for f in out.glob("*.safetensors") for t in load_file(f).values())
    print(f"wrote {out} ({n_params / 1e6:.2f}M parameters, {args.dtype}, seed {args.seed})")


if __name__ == "__main__":
    main()
