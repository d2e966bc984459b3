"""Fine-tune the built-in model's MTP layer to draft several tokens a step (chained drafts).

``--speculative-num-steps N`` runs the one MTP layer N times a step: the first run reads the
target's final-normed hidden state at position t and token t+1 and drafts t+2; each further run,
one position on, reads the layer's own final-normed output and the draft before it. The layer as
``train_tiny.py`` leaves it learned only the first kind of input: fed its own output its second
draft is right about 57% of the time. This script trains it on every depth at once, the main
model frozen (its tensors are written back bit for bit, so its answers do not change).

Teacher-forced, exactly as the engine runs the layer: the depth-d stream at position p+d-1 holds
(the depth d-1 stream's normed output at p+d-2, token p+d) and predicts token p+d+1. The streams
are concatenated into one sequence whose mask lets a depth-d query at position p+d-1 see what the
engine's cache holds when it runs: the depth-1 keys up to position p, and at each later position
q <= p+d-1 the key of the stream that wrote it (depth q-p+1). Loss: the mean cross-entropy of every
depth on the assistant's reply tokens; the router's bias stays as trained.

Usage: python scripts/train_tiny_mtp.py [--checkpoint DIR] [--out DIR] [--depths 3] [--steps N]
(the shipped layer: ``OMP_WAIT_POLICY=ACTIVE python scripts/train_tiny_mtp.py`` on a quiet machine;
benchmarks/results/tiny_chat_training.md has its record)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from train_tiny import (
    DEFAULT_OUT,
    Batch,
    Encoder,
    MTPModule,
    TrainingData,
    autocast,
    build_tokenizer,
    hf_config,
    learning_rate,
    pad,
)
from transformers import DeepseekV3ForCausalLM

from dsinfer.evals.tasks import TASKS, held_out
from harness.checkpoints import to_hf_memory_layout


def load(checkpoint: Path) -> tuple[DeepseekV3ForCausalLM, MTPModule, dict[str, torch.Tensor]]:
    """The main model (float32, frozen), its MTP module, and the checkpoint's tensors as stored."""
    stored = load_file(checkpoint / "model.safetensors")
    tokenizer = build_tokenizer()
    config = hf_config(tokenizer.get_vocab_size(with_added_tokens=True))
    model = DeepseekV3ForCausalLM(config)
    prefix = f"model.layers.{config.num_hidden_layers}."  # the MTP layer's tensors
    main = to_hf_memory_layout({k: v.float() for k, v in stored.items() if not k.startswith(prefix)})
    missing, unexpected = model.load_state_dict(main, strict=False)
    if unexpected or [k for k in missing if not k.endswith("rotary_emb.inv_freq")]:
        raise ValueError(f"checkpoint does not fit the model: missing {missing}, unexpected {unexpected}")
    mtp = MTPModule(config)
    own = to_hf_memory_layout({k: v.float() for k, v in stored.items()}, prefix)
    module = {name: own.pop(name) for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight")}
    module["norm.weight"] = own.pop("shared_head.norm.weight")
    del own["shared_head.head.weight"], own["embed_tokens.weight"]  # the main model's, shared
    module.update({"layer." + k: v for k, v in own.items()})
    mtp.load_state_dict(module)
    model.requires_grad_(False)
    return model.eval(), mtp, stored


def chained_logits(
    model: DeepseekV3ForCausalLM, mtp: MTPModule, batch: Batch, depths: int
) -> list[torch.Tensor]:
    """Depth d's draft logits [B, T-1-d, V] (d = 1..depths): index p predicts token p+d+1."""
    ids, conversation = batch.ids, batch.conversation
    positions = batch.positions(conversation)
    length = ids.shape[1]
    with torch.no_grad():
        hidden = model.model(
            input_ids=ids, attention_mask=batch.attention_mask(conversation), position_ids=positions
        ).last_hidden_state
    n = length - 1 - depths  # positions p with a target for every depth
    streams, stream_pos = [], []
    # a deeper stream's input is the previous depth's output, so the layer runs once per depth,
    # each time over the streams so far (the earlier ones' outputs come out as before)
    logits: list[torch.Tensor] = []
    previous = hidden[:, :n]
    for d in range(1, depths + 1):
        emb = model.model.embed_tokens(ids[:, d : d + n])
        streams.append(mtp.eh_proj(torch.cat([mtp.enorm(emb), mtp.hnorm(previous)], dim=-1)))
        stream_pos.append(positions[:, d - 1 : d - 1 + n])
        x = torch.cat(streams, dim=1)
        pos = torch.cat(stream_pos, dim=1)
        mask = _chain_mask(conversation[:, :n], d)
        y = mtp.layer(
            x, attention_mask=mask, position_ids=pos, position_embeddings=model.model.rotary_emb(x, pos)
        )
        y = y[0] if isinstance(y, tuple) else y
        normed = mtp.norm(y[:, (d - 1) * n :])
        logits.append(model.lm_head(normed))
        previous = normed
    return logits


def _chain_mask(conversation: torch.Tensor, depths: int) -> torch.Tensor:
    """[B, 1, depths*n, depths*n] bool over the streams concatenated (stream d's index p is
    position p+d-1): a query of stream d at index p sees stream 1 at indices <= p, and stream e
    (2 <= e <= d) at index p only (the positions p+1..p+d-1 the engine's chained runs wrote), all
    within the query's conversation."""
    n = conversation.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    eye = torch.eye(n, dtype=torch.bool)
    same = conversation[:, :, None] == conversation[:, None, :]
    rows = []
    for d in range(1, depths + 1):
        blocks = [
            causal if e == 1 else (eye if e <= d else torch.zeros_like(eye)) for e in range(1, depths + 1)
        ]
        rows.append(torch.cat(blocks, dim=1))
    full = torch.cat(rows, dim=0)  # [depths*n, depths*n]
    same_all = same.repeat(1, depths, depths)
    return (full[None] & same_all)[:, None]


def chain_loss(
    model: DeepseekV3ForCausalLM, mtp: MTPModule, batch: Batch, depths: int
) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy of every depth on reply targets, and the number of those targets."""
    total, count = torch.zeros(()), 0
    for d, logits in enumerate(chained_logits(model, mtp, batch, depths), start=1):
        n = logits.shape[1]
        target = batch.ids[:, d + 1 : d + 1 + n]
        mask = batch.reply[:, d + 1 : d + 1 + n]
        total = total + F.cross_entropy(logits[mask].float(), target[mask], reduction="sum")
        count += int(mask.sum())
    return total, count


@torch.no_grad()
def hit_rates(
    model: DeepseekV3ForCausalLM, mtp: MTPModule, encoder: Encoder, depths: int, per_task: int
) -> dict[str, list[float]]:
    """task -> each depth's argmax hit rate on held-out replies' tokens."""
    mtp.eval()
    out = {}
    for task in TASKS:
        convs = [encoder.conversation([(q.prompt, q.reply)]) for q in held_out(task)[:per_task]]
        hits, totals = [0] * depths, [0] * depths
        for start in range(0, len(convs), 16):
            chunk = convs[start : start + 16]
            batch = pad([c for c, _ in chunk], [m for _, m in chunk], encoder.eos)
            for d, logits in enumerate(chained_logits(model, mtp, batch, depths), start=1):
                n = logits.shape[1]
                mask = batch.reply[:, d + 1 : d + 1 + n]
                right = logits.argmax(-1) == batch.ids[:, d + 1 : d + 1 + n]
                hits[d - 1] += int((right & mask).sum())
                totals[d - 1] += int(mask.sum())
        out[task] = [h / max(t, 1) for h, t in zip(hits, totals, strict=True)]
    mtp.train()
    return out


def save(mtp: MTPModule, model: DeepseekV3ForCausalLM, stored: dict[str, torch.Tensor], out: Path) -> None:
    """The checkpoint with the MTP layer's trained tensors (bf16; the router bias fp32), every
    other tensor as it was stored."""
    tensors = dict(stored)
    for name, tensor in mtp.checkpoint_tensors(model, model.config.num_hidden_layers).items():
        dtype = stored[name].dtype
        tensors[name] = tensor.detach().to(dtype).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(dict(sorted(tensors.items())), out / "model.safetensors", metadata={"format": "pt"})


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="writes model.safetensors only")
    parser.add_argument("--depths", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1800)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--length", type=int, default=192)
    parser.add_argument("--eval-size", type=int, default=64, help="held-out questions per task")
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)
    model, mtp, stored = load(args.checkpoint)
    encoder = Encoder(build_tokenizer())
    data = TrainingData(encoder, args.seed)
    print(f"before: {_cells(hit_rates(model, mtp, encoder, args.depths, args.eval_size))}", flush=True)
    params = [p for p in mtp.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    start, window_loss = time.monotonic(), 0.0
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr, args.warmup)
        batch = data.rows(args.rows, args.length)
        with autocast(args.bf16):
            total, count = chain_loss(model, mtp, batch, args.depths)
        loss = total / max(count, 1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        window_loss += loss.item()
        if (step + 1) % args.log_every == 0:
            print(
                f"step {step + 1}/{args.steps} loss {window_loss / args.log_every:.4f} "
                f"elapsed {time.monotonic() - start:.0f}s",
                flush=True,
            )
            window_loss = 0.0
    print(f"after: {_cells(hit_rates(model, mtp, encoder, args.depths, args.eval_size))}", flush=True)
    save(mtp, model, stored, args.out)
    print(f"wrote {args.out / 'model.safetensors'}", flush=True)


def _cells(rates: dict[str, list[float]]) -> str:
    return " ".join(f"{task} " + "/".join(f"{r:.3f}" for r in depth) for task, depth in rates.items())


if __name__ == "__main__":
    main()
