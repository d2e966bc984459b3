"""Train the built-in chat model (configs/models/tiny-chat/): a small DeepSeek-V3 with an MTP layer.

The model is transformers' ``DeepseekV3ForCausalLM`` (MLA with DeepSeek-V3's latent sizes,
kv_lora_rank 512 and qk_rope_head_dim 64; one dense layer then MoE layers of 16 routed experts,
top-4 in 2 of 4 groups, one shared expert; sigmoid noaux_tc routing) plus one MTP module built
from transformers' own decoder layer, as DeepSeek-V3 describes it: the module sees the main
model's final-normed hidden state at position t and the embedding of token t+1 and predicts token
t+2 with its own loss (weight ``--mtp-weight``); it shares the embedding and output head with the
main model during training and gets copies of them when saved.

Data: chat conversations rendered through the chat template (dsinfer.evals.tasks: arithmetic,
reversal, sorting, key lookup over long contexts), loss on the assistant's replies only. A step
is one batch of short conversations packed into rows plus one batch of lookup conversations (a
context and several questions about it). The router's score-correction bias is balanced without
an auxiliary loss, as DeepSeek-V3 does: after each step it moves by ``--bias-rate`` towards the
experts that got fewer tokens than the mean.

Deterministic for a seed and thread count (model init from torch.manual_seed, data from one
random.Random). Progress: one line per logging interval and per evaluation, which measures
held-out exact match by teacher forcing (every answer token and the closing eos the argmax:
the same as a greedy answer) and the MTP draft's hit rate on the answers.

Writes the checkpoint in DeepSeek's Hugging Face layout, in bf16 (the router bias stays fp32):
config.json, model.safetensors (the MTP layer as model.layers.<num_hidden_layers>.*),
generation_config.json, tokenizer.json, tokenizer_config.json, chat_template.jinja.

Usage: python scripts/train_tiny.py [--out DIR] [--steps N] [--seed S] [--threads T]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from torch import nn
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_tiny_tokenizer import (
    ASSISTANT,
    BOS,
    CHAT_TEMPLATE,
    EOS,
    SKIPPED_ON_DECODE,
    SPECIAL_TOKENS,
    USER,
    tokenizer_config,
    write_json,
)

from dsinfer.evals.tasks import (
    SHORT_TASKS,
    TASKS,
    TOKENIZER_WORDS,
    TRAIN_LOOKUP_LINES,
    Question,
    held_out,
    held_out_keys,
    lookup_context,
    lookup_question,
    make_question,
    render_context,
)

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "configs" / "models" / "tiny-chat"
MODEL_MAX_LENGTH = 2048

# DeepSeek-V3's architecture at a small width. kv_lora_rank 512 and qk_rope_head_dim 64 are V3's
# own latent sizes (the only ones vLLM's CPU MLA backends take); the rest is small.
ARCHITECTURE: dict = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 128,
    "intermediate_size": 512,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 64,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 64,
    "v_head_dim": 32,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": MODEL_MAX_LENGTH,
    "rope_theta": 10000,
    "rope_scaling": None,
    "rope_interleave": True,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1,
    "initializer_range": 0.02,
    "attention_bias": False,
    "attention_dropout": 0.0,
}


# ---------------------------------------------------------------------------------------------
# Tokenizer: one token per byte (so one per digit and letter), a few whole words, the chat markers


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer writes)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def build_tokenizer() -> Tokenizer:
    """Word-level over byte-level pieces: every byte is a token, plus TOKENIZER_WORDS (each only
    where no letter follows it); the special tokens first (bos 0, eos 1), as in DeepSeek-V3."""
    chars = _byte_chars()
    as_bytes = {word: "".join(chars[b] for b in word.encode()) for word in TOKENIZER_WORDS}
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for b in range(256):
        vocab[chars[b]] = len(vocab)
    for word in TOKENIZER_WORDS:
        vocab[as_bytes[word]] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    words = "|".join(re.escape(as_bytes[w]) for w in TOKENIZER_WORDS)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            pre_tokenizers.Split(Regex(f"(?:{words})(?![A-Za-z])|."), behavior="isolated"),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, 0)]
    )
    return tokenizer


def write_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    data = json.loads(tokenizer.to_str())
    for entry in data["added_tokens"]:
        entry["special"] = entry["content"] in SKIPPED_ON_DECODE
        entry["normalized"] = False
    write_json(out / "tokenizer.json", data)
    write_json(out / "tokenizer_config.json", {**tokenizer_config(), "model_max_length": MODEL_MAX_LENGTH})
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# Conversations -> token ids and loss masks


class Encoder:
    """Token ids of a conversation as the chat template renders it, with the reply positions."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.bos, self.eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
        self.user, self.assistant = tokenizer.token_to_id(USER), tokenizer.token_to_id(ASSISTANT)

    def text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def conversation(self, turns: list[tuple[str, str]]) -> tuple[list[int], list[bool]]:
        """bos, then per turn: User prompt Assistant reply eos. Mask: True at reply tokens and eos."""
        ids, mask = [self.bos], [False]
        for prompt, reply in turns:
            head = [self.user, *self.text(prompt), self.assistant]
            tail = [*self.text(reply), self.eos]
            ids += head + tail
            mask += [False] * len(head) + [True] * len(tail)
        return ids, mask


class TrainingData:
    """Seeded stream of conversations over the task mix; held-out questions are never drawn."""

    def __init__(self, encoder: Encoder, seed: int) -> None:
        self.encoder = encoder
        self.rng = random.Random(seed)
        self.excluded = held_out_keys()

    def question(self, task: str) -> Question:
        while True:
            q = make_question(task, self.rng)
            if q.key not in self.excluded:
                return q

    def short_conversation(self) -> tuple[list[int], list[bool]]:
        """1 to 3 turns, each a task drawn with weights favouring the carries of add and sub."""
        turns = self.rng.choices([1, 2, 3], weights=[2, 1, 1])[0]
        tasks = self.rng.choices(SHORT_TASKS, weights=[3, 3, 2, 2, 2], k=turns)
        qs = [self.question(t) for t in tasks]
        return self.encoder.conversation([(q.prompt, q.answer) for q in qs])

    def lookup_conversation(self) -> tuple[list[int], list[bool]]:
        """A context of "key: value" lines with a question, then up to 11 more questions on it."""
        table = lookup_context(self.rng, self.rng.randrange(*TRAIN_LOOKUP_LINES))
        keys = self.rng.choices(list(table), k=1 + self.rng.randint(0, 11))
        turns = [(render_context(table) + lookup_question(keys[0]), table[keys[0]])]
        turns += [(lookup_question(k), table[k]) for k in keys[1:]]
        return self.encoder.conversation(turns)

    def short_batch(self, rows: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` rows of ``length`` tokens, each packed with whole short conversations."""
        ids = torch.full((rows, length), self.encoder.eos, dtype=torch.long)
        mask = torch.zeros((rows, length), dtype=torch.bool)
        for r in range(rows):
            pos = 0
            while True:
                conv, conv_mask = self.short_conversation()
                if pos + len(conv) > length:
                    break
                ids[r, pos : pos + len(conv)] = torch.tensor(conv)
                mask[r, pos : pos + len(conv)] = torch.tensor(conv_mask)
                pos += len(conv)
        return ids, mask

    def lookup_batch(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        convs = [self.lookup_conversation() for _ in range(rows)]
        return pad([c for c, _ in convs], [m for _, m in convs], self.encoder.eos)


def pad(seqs: list[list[int]], masks: list[list[bool]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded batch (padding is masked out of the loss and, being last, unseen by causal attention)."""
    length = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.bool)
    for r, (s, m) in enumerate(zip(seqs, masks, strict=True)):
        ids[r, : len(s)] = torch.tensor(s)
        mask[r, : len(m)] = torch.tensor(m)
    return ids, mask


# ---------------------------------------------------------------------------------------------
# Model: transformers' DeepSeek-V3 plus DeepSeek's MTP module


class MTPModule(nn.Module):
    """x = eh_proj(concat(enorm(embed(token t+1)), hnorm(hidden t))) -> decoder layer -> norm -> head."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = DeepseekV3RMSNorm(hidden, eps)
        self.hnorm = DeepseekV3RMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = DeepseekV3DecoderLayer(config, layer_idx=config.num_hidden_layers)
        self.norm = DeepseekV3RMSNorm(hidden, eps)

    def forward(
        self, main: DeepseekV3ForCausalLM, hidden: torch.Tensor, next_ids: torch.Tensor
    ) -> torch.Tensor:
        """hidden [B, T, H] (final-normed, positions 0..T-1), next_ids [B, T] (tokens 1..T) -> logits [B, T, V]."""
        emb = main.model.embed_tokens(next_ids)
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))
        positions = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
        cos_sin = main.model.rotary_emb(x, positions)
        y = self.layer(x, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
        y = y[0] if isinstance(y, tuple) else y
        return main.lm_head(self.norm(y))

    def checkpoint_tensors(self, main: DeepseekV3ForCausalLM, layer: int) -> dict[str, torch.Tensor]:
        """DeepSeek's names: model.layers.<layer>.{enorm,hnorm,eh_proj,shared_head,embed_tokens,...}."""
        prefix = f"model.layers.{layer}."
        out = {
            prefix + "enorm.weight": self.enorm.weight,
            prefix + "hnorm.weight": self.hnorm.weight,
            prefix + "eh_proj.weight": self.eh_proj.weight,
            prefix + "shared_head.norm.weight": self.norm.weight,
            prefix + "shared_head.head.weight": main.lm_head.weight,
            prefix + "embed_tokens.weight": main.model.embed_tokens.weight,
        }
        for name, tensor in self.layer.state_dict().items():
            match = re.fullmatch(r"mlp\.experts\.(gate_up_proj|down_proj)", name)
            if match is None:
                out[prefix + name] = tensor
                continue
            for e in range(tensor.shape[0]):
                if match.group(1) == "down_proj":
                    out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = tensor[e]
                else:
                    gate, up = tensor[e].chunk(2, dim=0)
                    out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = gate
                    out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = up
        return out


def hf_config(vocab_size: int) -> DeepseekV3Config:
    keep = {k: v for k, v in ARCHITECTURE.items() if k not in ("architectures", "model_type")}
    return DeepseekV3Config(**keep, vocab_size=vocab_size, bos_token_id=0, eos_token_id=1)


class LoadCounter:
    """Tokens per routed expert per MoE gate during a step (for the bias update and the log)."""

    def __init__(self, gates: list[nn.Module], num_experts: int) -> None:
        self.gates = gates
        self.counts = torch.zeros(len(gates), num_experts)
        for i, gate in enumerate(gates):
            gate.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def record(module: nn.Module, inputs: tuple, output: tuple) -> None:
            self.counts[i] += torch.bincount(output[2].flatten(), minlength=self.counts.shape[1]).float()

        return record

    @torch.no_grad()
    def balance(self, rate: float) -> float:
        """Move each gate's bias towards under-loaded experts; returns the mean max/mean load ratio."""
        imbalance = 0.0
        for gate, counts in zip(self.gates, self.counts, strict=True):
            gate.e_score_correction_bias += rate * torch.sign(counts.mean() - counts)
            imbalance += float(counts.max() / counts.mean().clamp(min=1))
        self.counts.zero_()
        return imbalance / len(self.gates)


# ---------------------------------------------------------------------------------------------
# Training


@dataclass
class StepLoss:
    main: torch.Tensor
    mtp: torch.Tensor
    tokens: int


def losses(
    model: DeepseekV3ForCausalLM, mtp: MTPModule, ids: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(main logits [B,T,V] at t predicting t+1, mtp logits [B,T-1,V] at t predicting t+2, main
    target mask [B,T-1], mtp target mask [B,T-2])."""
    hidden = model.model(input_ids=ids).last_hidden_state
    logits = model.lm_head(hidden)
    mtp_logits = mtp(model, hidden[:, :-1], ids[:, 1:])
    return logits, mtp_logits, mask[:, 1:], mask[:, 2:]


def batch_loss(
    model: DeepseekV3ForCausalLM, mtp: MTPModule, ids: torch.Tensor, mask: torch.Tensor
) -> StepLoss:
    logits, mtp_logits, main_mask, mtp_mask = losses(model, mtp, ids, mask)
    main = F.cross_entropy(logits[:, :-1][main_mask], ids[:, 1:][main_mask], reduction="sum")
    draft = F.cross_entropy(mtp_logits[:, :-1][mtp_mask], ids[:, 2:][mtp_mask], reduction="sum")
    return StepLoss(main, draft, int(main_mask.sum()))


@torch.no_grad()
def evaluate(
    model: DeepseekV3ForCausalLM, mtp: MTPModule, encoder: Encoder, tasks: list[str], per_task: int
) -> dict[str, tuple[float, float]]:
    """task -> (teacher-forced exact match, MTP draft hit rate on answer tokens) on held-out questions."""
    model.eval()
    result = {}
    for task in tasks:
        questions = held_out(task)[:per_task]
        convs = [encoder.conversation([(q.prompt, q.answer)]) for q in questions]
        correct, hits, drafts = 0, 0, 0
        for start in range(0, len(convs), 16):
            chunk = convs[start : start + 16]
            ids, mask = pad([c for c, _ in chunk], [m for _, m in chunk], encoder.eos)
            logits, mtp_logits, main_mask, mtp_mask = losses(model, mtp, ids, mask)
            right = (logits[:, :-1].argmax(-1) == ids[:, 1:]) | ~main_mask
            correct += int(right.all(dim=1).sum())
            draft_right = mtp_logits[:, :-1].argmax(-1) == ids[:, 2:]
            hits += int((draft_right & mtp_mask).sum())
            drafts += int(mtp_mask.sum())
        result[task] = (correct / len(convs), hits / max(drafts, 1))
    model.train()
    return result


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(args: argparse.Namespace) -> tuple[DeepseekV3ForCausalLM, MTPModule, Tokenizer]:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer()
    encoder = Encoder(tokenizer)
    config = hf_config(tokenizer.get_vocab_size(with_added_tokens=True))
    model = DeepseekV3ForCausalLM(config)
    mtp = MTPModule(config)
    mtp.apply(model._init_weights)  # transformers' init (normal router and experts), as for the main layers
    model.train()
    mtp.train()
    params = [*model.parameters(), *mtp.parameters()]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    gates = [m for n, m in [*model.named_modules(), *mtp.named_modules()] if n.endswith("mlp.gate")]
    loads = LoadCounter(gates, config.n_routed_experts)
    data = TrainingData(encoder, args.seed)
    total = sum(p.numel() for p in params)
    print(
        f"model: {total / 1e6:.2f}M parameters (MTP and its shared embedding/head included), vocab "
        f"{config.vocab_size}, seed {args.seed}, {args.threads} thread(s), {args.steps} steps",
        flush=True,
    )
    start, tokens, window = time.monotonic(), 0, time.monotonic()
    window_tokens, window_loss, window_mtp = 0, 0.0, 0.0
    eval_tasks = list(TASKS)
    for step in range(args.steps):
        lr = learning_rate(step, args.steps, args.lr, args.warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr
        short = data.short_batch(args.short_rows, args.short_length)
        long = data.lookup_batch(args.lookup_rows)
        parts = [batch_loss(model, mtp, *batch) for batch in (short, long)]
        supervised = sum(p.tokens for p in parts)
        main = sum(p.main for p in parts) / supervised
        draft = sum(p.mtp for p in parts) / supervised
        (main + args.mtp_weight * draft).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        imbalance = loads.balance(args.bias_rate)
        step_tokens = short[0].numel() + long[0].numel()
        tokens += step_tokens
        window_tokens += step_tokens
        window_loss += main.item()
        window_mtp += draft.item()
        if (step + 1) % args.log_every == 0:
            now = time.monotonic()
            print(
                f"step {step + 1}/{args.steps} loss {window_loss / args.log_every:.4f} "
                f"mtp {window_mtp / args.log_every:.4f} lr {lr:.2e} load max/mean {imbalance:.2f} "
                f"{window_tokens / (now - window):.0f} tok/s tokens {tokens} elapsed {now - start:.0f}s",
                flush=True,
            )
            window, window_tokens, window_loss, window_mtp = now, 0, 0.0, 0.0
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            result = evaluate(model, mtp, encoder, eval_tasks, args.eval_size)
            cells = " ".join(f"{t} {acc:.3f}/{hit:.2f}" for t, (acc, hit) in result.items())
            print(f"eval step {step + 1} exact/mtp-hit: {cells}", flush=True)
    print(f"trained {tokens} tokens in {time.monotonic() - start:.0f}s", flush=True)
    return model, mtp, tokenizer


# ---------------------------------------------------------------------------------------------
# Checkpoint


def checkpoint_config(vocab_size: int) -> dict:
    """config.json as DeepSeek writes it (rope_scaling, topk_method, scoring_func), in bf16."""
    return {
        **ARCHITECTURE,
        "vocab_size": vocab_size,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    }


def save(model: DeepseekV3ForCausalLM, mtp: MTPModule, tokenizer: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, max_shard_size="100GB")
        tensors = {}
        for file in sorted(Path(tmp).glob("*.safetensors")):
            tensors.update(load_file(file))
    tensors.update(mtp.checkpoint_tensors(model, model.config.num_hidden_layers))
    stored = {
        name: t.detach().float()
        if name.endswith("e_score_correction_bias")
        else t.detach().to(torch.bfloat16)
        for name, t in sorted(tensors.items())
    }
    save_file(
        {k: v.contiguous() for k, v in stored.items()}, out / "model.safetensors", metadata={"format": "pt"}
    )
    write_json(out / "config.json", checkpoint_config(model.config.vocab_size))
    write_json(out / "generation_config.json", {"bos_token_id": 0, "eos_token_id": 1, "do_sample": False})
    write_tokenizer(tokenizer, out)
    size = (out / "model.safetensors").stat().st_size
    print(f"wrote {out} ({len(stored)} tensors, model.safetensors {size / 2**20:.1f} MiB)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (results depend on it bitwise)")
    parser.add_argument("--steps", type=int, default=1600)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--mtp-weight", type=float, default=0.3)
    parser.add_argument("--bias-rate", type=float, default=5e-3)
    parser.add_argument("--short-rows", type=int, default=16)
    parser.add_argument("--short-length", type=int, default=256)
    parser.add_argument("--lookup-rows", type=int, default=3)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument(
        "--eval-size", type=int, default=64, help="held-out questions per task per evaluation"
    )
    args = parser.parse_args()
    model, mtp, tokenizer = train(args)
    save(model, mtp, tokenizer, args.out)


if __name__ == "__main__":
    main()
