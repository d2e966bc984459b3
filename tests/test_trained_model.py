"""The shipped trained model (configs/models/tiny-chat): its tokenizer and chat template give the
token layout it was trained on, and transformers' DeepseekV3ForCausalLM loads the checkpoint
(ignoring the MTP layer) and answers held-out questions greedily with dsinfer's tokens (float32)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DeepseekV3ForCausalLM

from dsinfer import LLM
from dsinfer.base.presets import DEFAULT_MODEL, resolve_model
from dsinfer.base.tokenizer import Tokenizer
from dsinfer.evals.runner import OfflineClient, run_eval
from dsinfer.evals.tasks import TOKENIZER_WORDS, held_out
from harness.hf_reference import compare_tokens, hf_greedy_steps

PATH = resolve_model(DEFAULT_MODEL)[0]
PER_TASK = 2
PARITY_TASKS = ("add", "sub", "mul", "reverse", "sort", "lookup")  # lookup_1k: same path, 3x longer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(PATH)


def test_checkpoint_layout() -> None:
    config = json.loads((PATH / "config.json").read_text())
    # DeepSeek-V3's latent sizes and routing fields (what vLLM's CPU MLA backends and config parser need)
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"]) == (512, 64)
    assert (config["topk_method"], config["scoring_func"]) == ("noaux_tc", "sigmoid")
    assert config["num_nextn_predict_layers"] == 1
    assert (PATH / "model.safetensors").stat().st_size < 16 * 2**20


def test_one_token_per_digit_and_letter(tokenizer: Tokenizer) -> None:
    for text in ["0123456789", "abcdefghijklmnopqrstuvwxyz"]:
        assert len(tokenizer.encode(text, add_special_tokens=False)) == len(text)
    for word in TOKENIZER_WORDS:
        assert len(tokenizer.encode(word, add_special_tokens=False)) == 1
    # a known word inside a longer word is spelled out (words to reverse stay one token per letter)
    assert len(tokenizer.encode(" island", add_special_tokens=False)) == 7
    assert tokenizer.decode(tokenizer.encode("héllo 😀", add_special_tokens=False)) == "héllo 😀"


def test_chat_template_gives_the_training_layout(tokenizer: Tokenizer) -> None:
    """bos, then per turn: User, the prompt's tokens, Assistant, the reply's tokens, eos."""
    q = held_out("add")[0]
    messages = [*q.messages(), {"role": "assistant", "content": q.answer}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    rendered = tokenizer.encode(text, add_special_tokens=False)
    ids = {t: tokenizer.backend.token_to_id(t) for t in ("<｜User｜>", "<｜Assistant｜>")}
    expected = [
        tokenizer.bos_token_id,
        ids["<｜User｜>"],
        *tokenizer.encode(q.prompt, add_special_tokens=False),
        ids["<｜Assistant｜>"],
        *tokenizer.encode(q.answer, add_special_tokens=False),
        *tokenizer.eos_token_ids,
    ]
    assert rendered == expected


def test_transformers_greedy_answers_equal_dsinfer() -> None:
    llm = LLM(DEFAULT_MODEL, dtype="float32", kv_cache_memory="32MiB")
    client = OfflineClient(llm)
    report = run_eval(client, PARITY_TASKS, PER_TASK)
    hf = DeepseekV3ForCausalLM.from_pretrained(PATH, dtype=torch.float32).eval()
    eos = client.tokenizer.eos_token_ids
    for task in PARITY_TASKS:
        for q, ours in zip(held_out(task)[:PER_TASK], report.token_ids[task], strict=True):
            ref, ref_logits = hf_greedy_steps(hf, client.prompt_ids(q), len(ours) + 1, eos)
            compare_tokens(ref, [*ours, *eos], ref_logits)
    llm.engine.close()
