"""Train the built-in chat model (configs/models/tiny-chat/): a small DeepSeek-V3 with an MTP layer.

The model is transformers' ``DeepseekV3ForCausalLM`` (MLA with DeepSeek-V3's latent sizes,
kv_lora_rank 512 and qk_rope_head_dim 64; one dense layer then MoE layers of 16 routed experts,
top-4 in 2 of 4 groups, one shared expert; sigmoid noaux_tc routing) plus one MTP module built
from transformers' own decoder layer, as DeepSeek-V3 describes it: the module sees the main
model's final-normed hidden state at position t and the embedding of token t+1 and predicts token
t+2 with its own loss (weight ``--mtp-weight``); it shares the embedding and output head with the
main model during training and gets copies of them when saved.

Data, in three phases (benchmarks/results/tiny_chat_training.md tells why):

1. ``--induction-steps``: copy sequences, a random run of letters and digits followed by itself
   with no delimiter (loss on the second run). Only an induction head predicts it (find the current
   token earlier, copy what followed it); it forms within a few hundred steps here, where the
   lookup alone never formed one in 140,000 lookups.
2. ``--table-steps``: table conversations only: "Repeat the lines." of a small table (the reply is
   its lines shuffled: every token after a line's first letter is a copy by key, dense targets in
   the lookup's own format) or lookups in it. The copy moves into the lookup's format.
3. The task mix: chat conversations rendered through the chat template (dsinfer.evals.tasks:
   arithmetic, reversal, sorting, key lookup, and the training-only "lines"), loss on the
   assistant's replies only. A step is one batch of rows packed with short conversations of 1-3
   turns, each turn a task drawn with ``--task-weights`` (a lookup or lines turn brings its own
   table of 2-8 lines), plus ``--lookup-rows`` rows of one lookup conversation each over a large
   table (up to 111 lines, as many as fit ``--lookup-length``) with up to 12 questions.
   A multiplication's reply thinks it through first (``<think>7 * 30 = 210`` ... ``</think>266``,
   dsinfer.evals.tasks.long_multiplication): answered directly, the tens digit of unseen products
   never generalized past three quarters. Its reply is about ten times as many loss tokens as an
   addition's and the loss is a mean over tokens, so the default weights draw multiplication
   less often than the other arithmetic (a third of the loss tokens), or the other tasks learn
   late.

Packed conversations do not see each other: attention is causal within each conversation and its
positions start at 0, as when it is served alone (without this, digits of the other questions in a
row distract sorting and arithmetic: at equal steps a 2-layer model sorted 16% instead of 38% and
reversed none instead of 8% of held-out questions). The router's
score-correction bias is balanced without an auxiliary loss, as DeepSeek-V3 does: after each step
it moves by ``--bias-rate`` towards the experts that got fewer tokens than the mean.

Tokenizer: one token per byte (so per letter), a few whole words, the chat markers, and a digit's
token tells its place in its number (ones, tens, hundreds, higher), so that the digits of a sum
line up by token rather than by counting positions.

Deterministic for a seed and thread count (model init from torch.manual_seed, data from one
random.Random, torch's deterministic kernels) and ``--eval-every`` (an evaluation's forwards
count in the router loads of the next bias update). Progress: one line per logging interval and
per evaluation, which measures held-out exact match by teacher forcing (every answer token and the
closing eos the argmax: the same as a greedy answer) and the MTP draft's hit rate on the answers.

Writes the checkpoint in DeepSeek's Hugging Face layout, in bf16 (the router bias stays fp32):
config.json, model.safetensors (the MTP layer as model.layers.<num_hidden_layers>.*),
generation_config.json, tokenizer.json, tokenizer_config.json, chat_template.jinja.

Usage: python scripts/train_tiny.py [--out DIR] [--steps N] [--seed S] [--threads T]
(the shipped checkpoint: ``OMP_WAIT_POLICY=ACTIVE python scripts/train_tiny.py`` on a quiet machine)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import string
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# OpenMP threads that spin while waiting lose their core to the other jobs on a shared machine:
# 2 spinning threads ran at a tenth of 1 thread's tokens/s under a load of 15 on 2 cores. On a
# quiet machine spinning is faster (a step of the recipe 0.87 s against 1.2 s passive): the
# recipe's run sets OMP_WAIT_POLICY=ACTIVE, which this keeps. Set before torch starts OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from torch import nn
from transformers import AttentionInterface, DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

from dsinfer.evals.tasks import (
    END_THINK,
    LINE_TOKENS,
    SHORT_TASKS,
    TASKS,
    TOKENIZER_WORDS,
    TRAIN_LOOKUP_LINES,
    Question,
    final_answer,
    held_out,
    held_out_keys,
    lookup_context,
    lookup_question,
    make_question,
    multiplication,
    render_context,
)
from harness.checkpoints import V3_ROUTING
from harness.provenance import REPO
from harness.tiny_tokenizer import (
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

DEFAULT_OUT = REPO / "configs" / "models" / "tiny-chat"
MODEL_MAX_LENGTH = 2048
SHORT_LOOKUP_LINES = (2, 9)  # [min, max) lines of the tables in short conversations
# The tasks of short conversations, in --task-weights order; "lines" (repeat a small table's lines
# in a shuffled order) is training only: a dense copy in the lookup's own format.
MIX_TASKS = (*SHORT_TASKS, "lookup", "lines")
DEFAULT_TASK_WEIGHTS = (6, 7, 2, 3, 3, 1, 1)
DEFAULT_WIDE_MUL_SHARE = 0.0  # of multiplications drawn with a 3-digit operand (wide_multiplication)
DEFAULT_LOOKUP_ROWS = 1  # per step, each one lookup conversation of up to --lookup-length tokens
DEFAULT_INDUCTION_STEPS = 500  # steps of copy sequences first
DEFAULT_TABLE_STEPS = 200  # then steps of table conversations (TABLE_LINES_SHARE of them "lines")
TABLE_LINES_SHARE = 0.7
LINES_TABLE = (3, 9)  # [min, max) lines of a "lines" turn's table
COPY_ALPHABET = string.ascii_lowercase + string.digits
COPY_RUN = (8, 40)  # characters of a copy sequence's random run
# Tokens of a lookup conversation besides its table's lines (bos, markers, question, reply).
LOOKUP_OVERHEAD = 40

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
    **V3_ROUTING,
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


# A digit's token says its place in its number: ones, tens, hundreds, or higher (counted from the
# right), so that a sum's digits line up by token rather than by counting positions. Each
# (place, digit) is a private-use character the normalizer writes and the decoder turns back.
DIGIT_PLACES = ("(?=[0-9]{3})", "(?=[0-9]{2}(?![0-9]))", "(?=[0-9](?![0-9]))", "(?![0-9])")


def place_digit(place: int, digit: int) -> str:
    return chr(0xE000 + 10 * place + digit)


def build_tokenizer() -> Tokenizer:
    """Word-level over byte-level pieces: every byte is a token, plus TOKENIZER_WORDS (each only
    where no letter follows it) and the 40 place-value digits; the special tokens first (bos 0,
    eos 1), as in DeepSeek-V3."""
    chars = _byte_chars()
    digits = [place_digit(p, d) for p in range(len(DIGIT_PLACES)) for d in range(10)]
    pieces = {piece: "".join(chars[b] for b in piece.encode()) for piece in (*TOKENIZER_WORDS, *digits)}
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for b in range(256):
        vocab[chars[b]] = len(vocab)
    for as_bytes in pieces.values():
        vocab[as_bytes] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    tokenizer.normalizer = normalizers.Sequence(
        [
            normalizers.Replace(Regex(f"{d}{lookahead}"), place_digit(p, d))
            for p, lookahead in enumerate(DIGIT_PLACES)
            for d in range(10)
        ]
    )
    words = "|".join(re.escape(pieces[w]) for w in TOKENIZER_WORDS)
    places = "|".join(re.escape(pieces[d]) for d in digits)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            pre_tokenizers.Split(Regex(f"(?:{words})(?![A-Za-z])|{places}|."), behavior="isolated"),
        ]
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.ByteLevel(),
            *(decoders.Replace(place_digit(p, d), str(d)) for p in range(4) for d in range(10)),
        ]
    )
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
        """bos, then per turn: User prompt Assistant reply eos. Mask: True at reply tokens and eos.
        As the chat template renders a history, a reply that thought is only its answer when a
        turn follows, and out of the loss (the model learns to think, not to skip it)."""
        ids, mask = [self.bos], [False]
        for i, (prompt, reply) in enumerate(turns):
            head = [self.user, *self.text(prompt), self.assistant]
            learnt = i == len(turns) - 1 or END_THINK not in reply
            tail = [*self.text(reply if learnt else final_answer(reply)), self.eos]
            ids += head + tail
            mask += [False] * len(head) + [learnt] * len(tail)
        return ids, mask


def task_weights_problem(weights: tuple[int, ...]) -> str | None:
    """What is wrong with draw weights for MIX_TASKS, or None."""
    if len(weights) != len(MIX_TASKS) or min(weights) < 0 or sum(weights) == 0:
        return f"task weights {weights}: expected {len(MIX_TASKS)} non-negative integers, not all 0"
    return None


def wide_multiplication(rng: random.Random) -> Question:
    """A 1-digit by 3-digit product, either order: training only (the task is 1-digit by
    2-digit). The 2-digit task has 900 distinct pairs, 700 of them trainable, few enough to
    memorize (the checkpoint of 2026-11-25 answered 200/200 trained pairs and 142/200 held-out
    ones); products with a 3-digit operand share its per-digit products and carries but are too
    many to memorize. Tried at 0.5: less memorized, no better on the held-out products
    (benchmarks/results/tiny_chat_training.md)."""
    return multiplication(rng, 100, 999)


class TrainingData:
    """Seeded stream of conversations over the task mix; held-out questions are never drawn."""

    def __init__(
        self,
        encoder: Encoder,
        seed: int,
        task_weights: tuple[int, ...] = DEFAULT_TASK_WEIGHTS,
        wide_mul_share: float = DEFAULT_WIDE_MUL_SHARE,
    ) -> None:
        if (problem := task_weights_problem(task_weights)) is not None:
            raise ValueError(problem)
        if not 0.0 <= wide_mul_share <= 1.0:
            raise ValueError(f"wide_mul_share {wide_mul_share}: expected a fraction in [0, 1]")
        self.encoder = encoder
        self.rng = random.Random(seed)
        self.excluded = held_out_keys()
        self.task_weights = task_weights
        self.wide_mul_share = wide_mul_share

    def question(self, task: str) -> Question:
        if task == "mul" and self.wide_mul_share > 0 and self.rng.random() < self.wide_mul_share:
            return wide_multiplication(self.rng)
        while True:
            q = make_question(task, self.rng)
            if q.key not in self.excluded:
                return q

    def short_conversation(self) -> tuple[list[int], list[bool]]:
        """1 to 3 turns, each a task of MIX_TASKS drawn with ``task_weights``; a lookup turn here
        brings a small table of its own (SHORT_LOOKUP_LINES), the long rows bring large ones."""
        turns = self.rng.choices([1, 2, 3], weights=[2, 1, 1])[0]
        tasks = self.rng.choices(MIX_TASKS, weights=self.task_weights, k=turns)
        makers = {"lookup": self.short_lookup, "lines": self.repeat_lines}
        qs = [makers[t]() if t in makers else self.question(t) for t in tasks]
        return self.encoder.conversation([(q.prompt, q.reply) for q in qs])

    def table_conversation(self) -> tuple[list[int], list[bool]]:
        """A "lines" turn (TABLE_LINES_SHARE of them) or 1 to 4 lookups on one small table."""
        if self.rng.random() < TABLE_LINES_SHARE:
            q = self.repeat_lines()
            return self.encoder.conversation([(q.prompt, q.reply)])
        table = lookup_context(self.rng, self.rng.randrange(*SHORT_LOOKUP_LINES))
        keys = self.rng.choices(list(table), k=self.rng.randint(1, 4))
        turns = [(render_context(table) + lookup_question(keys[0]), table[keys[0]])]
        return self.encoder.conversation(turns + [(lookup_question(k), table[k]) for k in keys[1:]])

    def repeat_lines(self) -> Question:
        """A small table, then "Repeat the lines."; the reply is its lines in a shuffled order. Each
        reply token after a line's first letter is a copy from the context by the retrieval the
        lookup needs (the key's next letters, then its value): dense targets where a lookup has 3."""
        table = lookup_context(self.rng, self.rng.randrange(*LINES_TABLE))
        lines = list(table.items())
        self.rng.shuffle(lines)
        return Question(
            "lines", render_context(table) + "Repeat the lines.", render_context(dict(lines)), "lines"
        )

    def short_lookup(self) -> Question:
        table = lookup_context(self.rng, self.rng.randrange(*SHORT_LOOKUP_LINES))
        key = self.rng.choice(list(table))
        prompt = render_context(table) + lookup_question(key)
        return Question("lookup", prompt, table[key], f"lookup:{prompt}")

    def copy_sequence(self) -> tuple[list[int], list[bool]]:
        """bos, a random run of letters and digits (COPY_RUN characters), then the same tokens again,
        with no delimiter between them: the second run can be predicted only by finding the current
        token earlier and copying what followed it (an induction head). Loss on the second run
        from its second token (nothing tells where it starts)."""
        length = self.rng.randint(*COPY_RUN)
        run = self.encoder.text("".join(self.rng.choice(COPY_ALPHABET) for _ in range(length)))
        return [self.encoder.bos, *run, *run], [False] * (len(run) + 2) + [True] * (len(run) - 1)

    def lookup_conversation(self, max_tokens: int) -> tuple[list[int], list[bool]]:
        """A context of "key: value" lines with a question, then up to 11 more questions on it (as
        many as fit ``max_tokens``; the table has at most as many lines as fit with one question)."""
        most = min(TRAIN_LOOKUP_LINES[1], (max_tokens - LOOKUP_OVERHEAD) // LINE_TOKENS + 1)
        if most <= TRAIN_LOOKUP_LINES[0]:
            raise ValueError(
                f"lookup rows of {max_tokens} tokens hold no table of {TRAIN_LOOKUP_LINES[0]} lines"
            )
        table = lookup_context(self.rng, self.rng.randrange(TRAIN_LOOKUP_LINES[0], most))
        keys = self.rng.choices(list(table), k=1 + self.rng.randint(0, 11))
        turns = [(render_context(table) + lookup_question(keys[0]), table[keys[0]])]
        turns += [(lookup_question(k), table[k]) for k in keys[1:]]
        ids, mask = self.encoder.conversation(turns)
        while len(ids) > max_tokens and len(turns) > 1:
            turns.pop()
            ids, mask = self.encoder.conversation(turns)
        return ids, mask

    def lookup_rows(self, rows: int, max_tokens: int) -> Batch:
        """``rows`` lookup conversations (lookup_conversation), one per row, padded to the longest:
        a row is as long as its table, not ``max_tokens``."""
        conversations = [self.lookup_conversation(max_tokens) for _ in range(rows)]
        return pad([ids for ids, _ in conversations], [mask for _, mask in conversations], self.encoder.eos)

    def rows(
        self, rows: int, length: int, fill: Callable[[], tuple[list[int], list[bool]]] | None = None
    ) -> Batch:
        """``rows`` rows of ``length`` tokens, each filled with whole sequences of ``fill()`` (by
        default short conversations) until the next does not fit."""
        fill = fill or self.short_conversation
        ids = torch.full((rows, length), self.encoder.eos, dtype=torch.long)
        reply = torch.zeros((rows, length), dtype=torch.bool)
        conversation = torch.full((rows, length), -1, dtype=torch.long)
        for r in range(rows):
            pos, index = 0, 0
            conv, conv_mask = fill()
            for _ in range(100):  # a rare 3-table conversation: draw again
                if len(conv) <= length:
                    break
                conv, conv_mask = fill()
            else:
                raise ValueError(f"conversations of {len(conv)} tokens do not fit rows of {length}")
            while pos + len(conv) <= length:
                ids[r, pos : pos + len(conv)] = torch.tensor(conv)
                reply[r, pos : pos + len(conv)] = torch.tensor(conv_mask)
                conversation[r, pos : pos + len(conv)] = index
                pos, index = pos + len(conv), index + 1
                conv, conv_mask = fill()
        return Batch(ids, reply, conversation)


@dataclass
class Batch:
    """Rows of packed conversations. Each conversation attends only to itself and its positions
    start at 0, as when it is served alone."""

    ids: torch.Tensor  # [B, T]
    reply: torch.Tensor  # [B, T] bool: the assistant's reply tokens and their eos (the loss)
    conversation: torch.Tensor  # [B, T]: which conversation of its row a token belongs to

    @property
    def num_tokens(self) -> int:
        return self.ids.numel()

    def positions(self, conversation: torch.Tensor) -> torch.Tensor:
        index = torch.arange(conversation.shape[1]).expand_as(conversation)
        first = torch.ones_like(conversation, dtype=torch.bool)
        first[:, 1:] = conversation[:, 1:] != conversation[:, :-1]
        start = torch.where(first, index, torch.zeros_like(index)).cummax(dim=1).values
        return index - start

    @staticmethod
    def attention_mask(conversation: torch.Tensor) -> torch.Tensor:
        """[B, 1, T, T] bool: causal within each conversation."""
        length = conversation.shape[1]
        same = conversation[:, :, None] == conversation[:, None, :]
        return (same & torch.ones(length, length, dtype=torch.bool).tril())[:, None]


def pad(seqs: list[list[int]], masks: list[list[bool]], pad_id: int) -> Batch:
    """One conversation per row, right-padded (padding is out of the loss and, being last, unseen)."""
    length = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), length), pad_id, dtype=torch.long)
    reply = torch.zeros((len(seqs), length), dtype=torch.bool)
    for r, (s, m) in enumerate(zip(seqs, masks, strict=True)):
        ids[r, : len(s)] = torch.tensor(s)
        reply[r, : len(m)] = torch.tensor(m)
    return Batch(ids, reply, torch.zeros_like(ids))


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
        self,
        main: DeepseekV3ForCausalLM,
        hidden: torch.Tensor,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        attention_mask: torch.Tensor,
    ) -> torch.Tensor:
        """hidden [B, T, H] (final-normed, at ``positions``), next_ids [B, T] (the tokens after) -> logits [B, T, V]."""
        emb = main.model.embed_tokens(next_ids)
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))
        cos_sin = main.model.rotary_emb(x, positions)
        y = self.layer(x, attention_mask=attention_mask, position_ids=positions, position_embeddings=cos_sin)
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


PADDED_SDPA = "sdpa_padded_values"


def padded_sdpa(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention with the values zero-padded to the query/key head size (32 ->
    96): torch takes its fused CPU kernel only for equal head sizes and otherwise its math path,
    which holds every [T, T] score (1.3-2x slower a step, 2x slower on 1k-token rows here). The
    padded output columns are zeros and dropped."""
    padded = F.pad(value, (0, query.shape[-1] - value.shape[-1]))
    out, weights = sdpa_attention_forward(module, query, key, padded, attention_mask, **kwargs)
    return out[..., : value.shape[-1]], weights


def hf_config(vocab_size: int) -> DeepseekV3Config:
    keep = {k: v for k, v in ARCHITECTURE.items() if k not in ("architectures", "model_type")}
    config = DeepseekV3Config(**keep, vocab_size=vocab_size, bos_token_id=0, eos_token_id=1)
    AttentionInterface.register(PADDED_SDPA, padded_sdpa)  # transformers' extension point, idempotent
    config._attn_implementation = PADDED_SDPA
    return config


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
    model: DeepseekV3ForCausalLM, mtp: MTPModule, batch: Batch
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(main logits [B,T,V] at t predicting t+1, mtp logits [B,T-1,V] at t predicting t+2, main
    target mask [B,T-1], mtp target mask [B,T-2])."""
    conversation = batch.conversation
    positions = batch.positions(conversation)
    hidden = model.model(
        input_ids=batch.ids, attention_mask=batch.attention_mask(conversation), position_ids=positions
    ).last_hidden_state
    logits = model.lm_head(hidden)
    mtp_logits = mtp(
        model,
        hidden[:, :-1],
        batch.ids[:, 1:],
        positions[:, :-1],
        batch.attention_mask(conversation[:, :-1]),
    )
    return logits, mtp_logits, batch.reply[:, 1:], batch.reply[:, 2:]


def batch_loss(model: DeepseekV3ForCausalLM, mtp: MTPModule, batch: Batch) -> StepLoss:
    logits, mtp_logits, main_mask, mtp_mask = losses(model, mtp, batch)
    ids = batch.ids
    main = F.cross_entropy(logits[:, :-1][main_mask], ids[:, 1:][main_mask], reduction="sum")
    draft = F.cross_entropy(mtp_logits[:, :-1][mtp_mask], ids[:, 2:][mtp_mask], reduction="sum")
    return StepLoss(main, draft, int(main_mask.sum()))


@torch.no_grad()
def evaluate(
    model: DeepseekV3ForCausalLM,
    mtp: MTPModule,
    encoder: Encoder,
    tasks: list[str],
    per_task: int,
    bf16: bool,
) -> dict[str, tuple[float, float]]:
    """task -> (teacher-forced exact match, MTP draft hit rate on answer tokens) on held-out questions."""
    model.eval()
    result = {}
    for task in tasks:
        questions = held_out(task)[:per_task]
        convs = [encoder.conversation([(q.prompt, q.reply)]) for q in questions]
        correct, hits, drafts = 0, 0, 0
        for start in range(0, len(convs), 16):
            chunk = convs[start : start + 16]
            batch = pad([c for c, _ in chunk], [m for _, m in chunk], encoder.eos)
            ids = batch.ids
            with autocast(bf16):
                logits, mtp_logits, main_mask, mtp_mask = losses(model, mtp, batch)
            right = (logits[:, :-1].argmax(-1) == ids[:, 1:]) | ~main_mask
            correct += int(right.all(dim=1).sum())
            draft_right = mtp_logits[:, :-1].argmax(-1) == ids[:, 2:]
            hits += int((draft_right & mtp_mask).sum())
            drafts += int(mtp_mask.sum())
        result[task] = (correct / len(convs), hits / max(drafts, 1))
    model.train()
    return result


def autocast(bf16: bool) -> torch.autocast:
    """bf16 matmuls (oneDNN, AMX where the CPU has it): about twice fp32's tokens/s here; weights,
    optimizer state and the losses' reductions stay fp32."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(args: argparse.Namespace) -> tuple[DeepseekV3ForCausalLM, MTPModule, Tokenizer]:
    torch.set_num_threads(args.threads)
    # Without this, two runs with 2 threads differ from the second step on: the gradient into the
    # MoE layers' input (the backward of transformers' expert loop, which gathers each expert's
    # tokens) sums in a thread-dependent order on CPU. No measurable cost here.
    torch.use_deterministic_algorithms(True)
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
    data = TrainingData(encoder, args.seed, args.task_weights, args.wide_mul_share)
    total = sum(p.numel() for p in params)
    print(
        f"model: {total / 1e6:.2f}M parameters (MTP and its shared embedding/head included), vocab "
        f"{config.vocab_size}, seed {args.seed}, {args.threads} thread(s), {args.steps} steps, "
        f"{'bf16 autocast' if args.bf16 else 'fp32'}",
        flush=True,
    )
    start, tokens, window = time.monotonic(), 0, time.monotonic()
    window_tokens, window_loss, window_mtp = 0, 0.0, 0.0
    eval_tasks = list(TASKS)
    for step in range(args.steps):
        lr = learning_rate(step, args.steps, args.lr, args.warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if step < args.induction_steps:
            batches = [data.rows(args.short_rows, args.short_length, fill=data.copy_sequence)]
        elif step < args.induction_steps + args.table_steps:
            batches = [data.rows(args.short_rows, args.short_length, fill=data.table_conversation)]
        else:
            batches = [data.rows(args.short_rows, args.short_length)]
            if args.lookup_rows > 0:
                batches.append(data.lookup_rows(args.lookup_rows, args.lookup_length))
        with autocast(args.bf16):
            parts = [batch_loss(model, mtp, batch) for batch in batches]
        supervised = sum(p.tokens for p in parts)
        main = sum(p.main for p in parts) / supervised
        draft = sum(p.mtp for p in parts) / supervised
        (main + args.mtp_weight * draft).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        imbalance = loads.balance(args.bias_rate)
        step_tokens = sum(batch.num_tokens for batch in batches)
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
            result = evaluate(model, mtp, encoder, eval_tasks, args.eval_size, args.bf16)
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


def task_weights_arg(text: str) -> tuple[int, ...]:
    """``--task-weights``: one non-negative integer per task of MIX_TASKS, comma-separated."""
    weights = tuple(int(w) for w in text.split(","))
    if (problem := task_weights_problem(weights)) is not None:
        raise argparse.ArgumentTypeError(problem)
    return weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (results depend on it bitwise)")
    parser.add_argument("--steps", type=int, default=4200)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=60)
    parser.add_argument(
        "--bf16", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast (default on)"
    )
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--mtp-weight", type=float, default=0.3)
    parser.add_argument("--bias-rate", type=float, default=5e-3)
    parser.add_argument("--short-rows", type=int, default=19)
    parser.add_argument("--short-length", type=int, default=192)
    parser.add_argument(
        "--lookup-rows",
        type=int,
        default=DEFAULT_LOOKUP_ROWS,
        help="rows per step that each hold one lookup conversation with a large table (0: none)",
    )
    parser.add_argument(
        "--lookup-length",
        type=int,
        default=1280,
        help="most tokens of a lookup row (its table has as many lines as fit, up to 111)",
    )
    parser.add_argument(
        "--induction-steps",
        type=int,
        default=DEFAULT_INDUCTION_STEPS,
        help="the first N steps fill the short rows with copy sequences (a random run of letters and "
        "digits, then itself again): they form the induction heads the lookup needs",
    )
    parser.add_argument(
        "--table-steps",
        type=int,
        default=DEFAULT_TABLE_STEPS,
        help="then N steps of table conversations only (repeat a table's lines, or look keys up in it): "
        "the copy moves into the lookup's format; the task mix follows",
    )
    parser.add_argument(
        "--task-weights",
        type=task_weights_arg,
        default=DEFAULT_TASK_WEIGHTS,
        help=f"comma-separated draw weights of {', '.join(MIX_TASKS)} in short conversations "
        f"(default {','.join(map(str, DEFAULT_TASK_WEIGHTS))})",
    )
    parser.add_argument(
        "--wide-mul-share",
        type=float,
        default=DEFAULT_WIDE_MUL_SHARE,
        help="fraction of the multiplications drawn as 1-digit by 3-digit products (training only: "
        "against memorizing the 2-digit task's 700 trainable pairs)",
    )
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument(
        "--eval-every",
        type=int,
        default=300,
        help="steps between held-out evaluations (their forwards count in the next router-bias update)",
    )
    parser.add_argument(
        "--eval-size", type=int, default=32, help="held-out questions per task per evaluation"
    )
    args = parser.parse_args()
    model, mtp, tokenizer = train(args)
    save(model, mtp, tokenizer, args.out)


if __name__ == "__main__":
    main()
