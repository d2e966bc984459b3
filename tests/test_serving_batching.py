"""The serving path's batching: a rank's token deltas of one step travel as one TokenDeltas
message, and a non-streamed choice is decoded once at its end with the text streaming gives."""

from __future__ import annotations

import random

import pytest

from dsinfer.base.presets import RANDOM_MODEL, resolve_model
from dsinfer.base.protocol import TokenDelta, TokenDeltas, decode, encode
from dsinfer.base.tokenizer import Tokenizer
from dsinfer.gateway.choice import ChoiceState


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(resolve_model(RANDOM_MODEL)[0])


def test_token_deltas_round_trip() -> None:
    batch = TokenDeltas(
        deltas=[
            TokenDelta(request_id="a/0", token_ids=[5], num_prompt_tokens=3),
            TokenDelta(request_id="b/0", token_ids=[7], logprobs=[{7: -0.5}], finish_reason="length"),
        ]
    )
    assert decode(encode(batch)) == batch


@pytest.mark.parametrize("seed", range(5))
def test_whole_response_text_equals_the_streamed_text(tokenizer: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    ids = [rng.randrange(2, tokenizer.vocab_size) for _ in range(40)]
    states = {
        incremental: ChoiceState(
            tokenizer,
            stops=[],
            skip_special_tokens=True,
            include_stop_str=False,
            reasoning=None,
            incremental=incremental,
        )
        for incremental in (True, False)
    }
    texts = {}
    for incremental, state in states.items():
        pieces = [
            state.update(TokenDelta(request_id="r", token_ids=ids[i : i + 3])).text for i in range(0, 39, 3)
        ]
        pieces.append(
            state.update(TokenDelta(request_id="r", token_ids=ids[39:], finish_reason="length")).text
        )
        texts[incremental] = "".join(pieces)
        assert state.text == texts[incremental] and state.token_ids == ids
    assert texts[False] == texts[True] == tokenizer.decode(ids, skip_special_tokens=True)
