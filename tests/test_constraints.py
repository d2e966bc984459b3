"""Constrained decoding in the engine: the token bitmask op against a plain loop, and grammars
through the offline engine with and without MTP (drafts are checked against the mask): every
output matches its grammar, and greedy outputs are the same tokens in both modes."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import pytest
import torch

from dsinfer import LLM, SamplingParams
from dsinfer.base import grammar
from dsinfer.ops.bitmask import apply_token_bitmask, bitmask_words
from harness.checkpoints import BuiltCheckpoint

pytestmark = pytest.mark.system

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
    },
    "required": ["id", "tags"],
    "additionalProperties": False,
}
PATTERN = r"[a-f]{2,4}-[0-9]{3}"


def test_bitmask_equals_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 100
    logits = torch.randn(5, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, bitmask_words(vocab)), dtype=torch.int32, generator=gen)
    rows = torch.tensor([0, 2, 4])
    want = logits.clone()
    for i, r in enumerate(rows.tolist()):
        for t in range(vocab):
            if not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                want[r, t] = float("-inf")
    assert torch.equal(apply_token_bitmask(logits, bitmask, rows), want)
    assert torch.equal(apply_token_bitmask(logits[rows], bitmask), want[rows])


@pytest.fixture(scope="module", params=[0, 1, 3], ids=["plain", "mtp", "mtp-3-steps"])
def llm(request: pytest.FixtureRequest, tiny_ckpt: BuiltCheckpoint) -> Iterator[LLM]:
    """``request.param`` MTP drafts a step (a constrained sequence verifies one of them)."""
    engine = LLM(
        str(tiny_ckpt.path),
        dtype="float32",
        kv_cache_memory="16MiB",
        speculative_mtp=request.param > 0,
        speculative_num_steps=max(request.param, 1),
    )
    yield engine
    engine.engine.close()


@pytest.fixture(scope="module")
def greedy_reference(tiny_ckpt: BuiltCheckpoint) -> list[list[int]]:
    engine = LLM(str(tiny_ckpt.path), dtype="float32", kv_cache_memory="16MiB")
    try:
        outs = engine.generate(["A record:", "Code"], _params(temperature=0), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    finally:
        engine.engine.close()


def _params(**kwargs: object) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=60, grammar=grammar.json_schema(SCHEMA), **kwargs),  # type: ignore[arg-type]
        SamplingParams(max_tokens=20, grammar=grammar.regex(PATTERN), **kwargs),  # type: ignore[arg-type]
    ]


def test_outputs_match_their_grammar(llm: LLM, greedy_reference: list[list[int]]) -> None:
    greedy = llm.generate(["A record:", "Code"], _params(temperature=0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in greedy] == greedy_reference
    sampled = llm.generate(["A record:", "Code"] * 3, _params(temperature=1.0, seed=7) * 3, use_tqdm=False)
    for out in [*greedy, *sampled]:
        text, reason = out.outputs[0].text, out.outputs[0].finish_reason
        assert reason == "stop", (text, reason)
        if text.startswith("{"):
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert re.fullmatch(PATTERN, text), text
