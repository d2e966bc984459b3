"""Migration in colocated mode through real processes: two colocated pools of one rank with MTP
speculation; one rank is killed with kill -9 while 8 streams run (half greedy, half seeded at
temperature 0.8, with logprobs). Every stream completes with the undisturbed run's tokens: the
dead rank's choices continue on the other pool from the tokens they had delivered."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import openai
import pytest

from dsinfer import LLM
from harness.checkpoints import BuiltCheckpoint
from harness.metrics import healthy, metric_value, parse_metrics
from harness.server import Server, serve, wait_until
from harness.streams import join_streams, mixed_specs, offline_tokens, start_streams, wait_streaming

pytestmark = pytest.mark.system

ENGINE = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-num-batched-tokens", "64"]
STREAMS, STREAM_TOKENS = 8, 40


@pytest.fixture(scope="module")
def server(tiny_ckpt: BuiltCheckpoint, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = [
        "--model",
        str(tiny_ckpt.path),
        *ENGINE,
        "--colocated",
        "--decode-pools",
        "2",
        "--speculative-mtp",
    ]
    with serve(args, tmp_path_factory.mktemp("migrate_colocated")) as s:
        yield s


def test_colocated_rank_killed_mid_stream_keeps_every_token(
    server: Server, tiny_ckpt: BuiltCheckpoint
) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=60, max_retries=0)
    specs = mixed_specs(STREAMS, "Migrate me, colocated", STREAM_TOKENS)
    offline = LLM(str(tiny_ckpt.path), dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=64)
    expected = offline_tokens(offline, specs)
    # ready once one pool is: a kill before the other is up would fail the start, not migrate
    wait_until(lambda: len(healthy(parse_metrics(server.metrics()))) == 2, "both pools up", 120)
    victims = server.rank_pids("colocated", pool=0)
    assert len(victims) == 1
    streams = start_streams(client, specs)
    wait_streaming(streams, timeout=120, context=lambda: server.log()[-3000:])
    os.kill(victims[0], signal.SIGKILL)
    join_streams(streams, timeout=120)
    assert [s.result for s in streams] == [("ok", "length")] * STREAMS, [s.result for s in streams]
    for s, want in zip(streams, expected, strict=True):
        assert s.tokens == want, s.spec
    migrated = metric_value(
        server.metrics(), "dsinfer_choice_migrations_total", cause="rank_died", streaming="true"
    )
    assert migrated >= 1
