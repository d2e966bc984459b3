"""Control-plane messages: typed round trips, validation on decode, and the size cap."""

from __future__ import annotations

import msgspec
import pytest

from dsinfer.base.protocol import MAX_MESSAGE_BYTES, MessageTooLargeError, TokenDelta, encode
from dsinfer.base.request_id import RequestKey, format_request_id, parse_request_id
from dsinfer.base.sampling_params import SamplingParams
from dsinfer.connector.messages import DecodeAdmit, PrefillDone, decode


def test_round_trip_keeps_types() -> None:
    admit = DecodeAdmit(
        request_id="r/1",
        prompt_token_ids=[1, 2, 3],
        params=SamplingParams(temperature=0.5, stop="x", logit_bias={7: -1.0}, n=1, seed=9),
        choice=1,
        prefill_worker="prefill/0/0",
        prefill_inbox="tcp://127.0.0.1:1",
    )
    assert decode(encode(admit)) == admit
    delta = TokenDelta(request_id="r/1", token_ids=[4], logprobs=[{4: -0.25, 5: -2.0}], finish_reason="stop")
    assert decode(encode(delta)) == delta


def test_decode_validates_sampling_params() -> None:
    frame = msgspec.msgpack.encode(
        {
            "type": "GenerateRequest",
            "request_id": "r",
            "prompt_token_ids": [1],
            "params": {"top_p": 2.0},
        }
    )
    with pytest.raises(msgspec.ValidationError, match="top_p"):
        decode(frame)


def test_no_tensor_sized_message_rides_the_control_plane() -> None:
    huge = PrefillDone(request_id="r", first_token=1, prompt_logprobs=[{i: 0.0} for i in range(2_000_000)])
    with pytest.raises(MessageTooLargeError, match="transfer library"):
        encode(huge)
    with pytest.raises(MessageTooLargeError):
        decode(b"\0" * (MAX_MESSAGE_BYTES + 1))


@pytest.mark.parametrize(
    ("key", "text"),
    [
        (RequestKey("cmpl-abc", 0), "cmpl-abc/0"),
        (RequestKey("chatcmpl-x/y", 12, 1), "chatcmpl-x/y/12~1"),  # the last "/" separates the choice
        (RequestKey("cmpl-7", 3, 20), "cmpl-7/3~20"),
    ],
)
def test_request_ids_format_and_parse(key: RequestKey, text: str) -> None:
    assert format_request_id(key) == text
    assert parse_request_id(text) == key
    assert parse_request_id(format_request_id(key.next_attempt())) == RequestKey(
        key.request, key.choice, key.attempt + 1
    )


@pytest.mark.parametrize("bad", ["cmpl-abc", "/0", "r/01", "r/1~0", "r/-1", "r/1~", "r/x"])
def test_request_id_parse_refuses_what_format_never_writes(bad: str) -> None:
    with pytest.raises(ValueError, match="not a worker request id"):
        parse_request_id(bad)
