"""Elastic EP for DeepSeek-V4: a step whose collective fails midway (a peer died) leaves some
layers with its tokens; the states are put back as they were (``SequenceState.snapshot``,
``SequenceStates.checkpoint``) and the step planned again gives the undisturbed tokens. End to
end: a decode rank of a 2-rank V4 pool killed mid-stream, the other serves on, every stream ends
with the undisturbed tokens, and the restarted rank rejoins."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch

from dsinfer import LLM
from dsinfer.model.v4_loader import load_v4
from dsinfer.model.v4_paged import SequenceStates
from dsinfer.ops import select_ops
from harness.metrics import healthy, metric_value, scrape, wait_kv_free, wait_workers
from harness.server import serve
from harness.streams import join_streams, mixed_specs, offline_tokens, start_streams, wait_streaming
from harness.v4_checkpoints import CONFIGS, add_v4_mtp, build_v4

pytest.importorskip("transformers")


class PeerDied(RuntimeError):
    pass


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_failed_step_puts_the_states_back(name: str, tmp_path: Path) -> None:
    build_v4(name, tmp_path, with_tokenizer=False)
    model = load_v4(tmp_path, select_ops("cpu", "torch"))
    ids = torch.randint(0, 320, (80,), generator=torch.Generator().manual_seed(4))
    states = SequenceStates(model.config, 4, 256, torch.float32, torch.device("cpu"))
    for n in (5, 9, 17, 33):  # around the window (8/12) and the blocks (4, 8/16)
        old = states.for_step("old", 0, [0])
        model.forward_many(ids[:n], [old], [n])
        restore = states.checkpoint(["old", "new"])
        new = states.for_step("new", 0, [1])
        layer = model.layers[len(model.layers) // 2]
        forward = layer.ffn.forward

        def dies(*args: object) -> torch.Tensor:
            raise PeerDied("a peer of the pool died")

        layer.ffn.forward = dies  # type: ignore[method-assign]
        with pytest.raises(PeerDied):
            model.forward_many(torch.cat([ids[n : n + 3], ids[:4]]), [old, new], [3, 4])
        layer.ffn.forward = forward  # type: ignore[method-assign]
        restore()
        assert len(states) == 1 and old.length == n
        again = model.compute_logits(model.forward_many(ids[n : n + 3], [old], [3]))
        whole = model.compute_logits(model(ids[: n + 3], model.new_state()))[n:]
        torch.testing.assert_close(again, whole, atol=1e-5, rtol=1e-5)
        states.keep([])


ENGINE = [
    "--dtype",
    "float32",
    "--kv-cache-memory",
    "16MiB",
    "--max-num-seqs",
    "16",
    "--max-num-batched-tokens",
    "64",
]
WORKERS = {"prefill/0/0", "decode/0/0", "decode/0/1"}  # a prefill rank, a decode pool of two
STREAMS, STREAM_TOKENS = 6, 40


def _rank_of(pid: int) -> int:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return int(json.loads(argv[argv.index(b"--args-json") + 1])["rank"])


@pytest.mark.system
def test_decode_rank_killed_the_v4_pool_serves_on(tmp_path: Path) -> None:
    """Decode rank 1 of a 2-rank V4 pool with MTP killed mid-stream: rank 0 serves on alone (the
    dead rank's experts staged from the checkpoint, the MTP layer's too; a step cut short by the
    death planned again over its sequences' states as they were, the MTP layer's windows
    included), /ready never fails, every stream ends with the undisturbed tokens (greedy and
    seeded); the launcher restarts rank 1 and it rejoins."""
    directory = tmp_path / "v4"
    build_v4("flash_like", directory, with_tokenizer=True)
    add_v4_mtp(directory, 0.3)
    offline = LLM(
        str(directory), dtype="float32", kv_cache_memory="16MiB", max_num_seqs=16, max_num_batched_tokens=64
    )
    specs = mixed_specs(STREAMS, " ".join(str(i) for i in range(60)), STREAM_TOKENS)
    want = offline_tokens(offline, specs)
    args = ["--model", str(directory), *ENGINE, "--speculative-mtp", "--decode-pool-size", "2"]
    with serve(args, tmp_path) as server:
        wait_workers(server.base_url, WORKERS, 120, server.log_tail)
        before = {_rank_of(pid): pid for pid in server.rank_pids("decode", pool=0)}
        assert sorted(before) == [0, 1], before
        streams = start_streams(server.openai_client(), specs)
        wait_streaming(streams, timeout=120, context=lambda: server.log()[-3000:])
        os.kill(before[1], signal.SIGKILL)
        ready = []
        while any(s.is_alive() for s in streams):
            ready.append(httpx.get(f"{server.base_url}/ready", timeout=5).status_code)
            time.sleep(0.05)
        join_streams(streams, timeout=120)
        assert set(ready) <= {200}, ready
        assert [s.result for s in streams] == [("ok", "length")] * STREAMS, [s.result for s in streams]
        assert [s.tokens for s in streams] == want
        assert "rank 0: a collective of generation 0 failed" in server.log()  # a shrink, not a restart
        metrics = server.metrics()
        assert 'dsinfer_pool_events_total{event="rank_died",pool="decode/0"} 1.0' in metrics
        assert (
            metric_value(metrics, "dsinfer_choice_migrations_total", cause="rank_died", streaming="true") >= 1
        )
        deadline = time.monotonic() + 120
        while True:  # rank 1 starts again alone and rejoins (rank 0 never restarted)
            after = {_rank_of(pid): pid for pid in server.rank_pids("decode", pool=0)}
            rejoined = (
                'dsinfer_pool_events_total{event="rank_rejoined",pool="decode/0"} 1.0' in server.metrics()
            )
            if rejoined and sorted(after) == [0, 1] and healthy(scrape(server.base_url)) >= WORKERS:
                break
            assert time.monotonic() < deadline, f"rank 1 did not rejoin: {after}\n{server.log()[-3000:]}"
            time.sleep(0.5)
        assert after[0] == before[0] and after[1] != before[1], (before, after)
        again = start_streams(server.openai_client(), specs)
        join_streams(again, timeout=120)
        assert [s.tokens for s in again] == want
        wait_kv_free(server.base_url)
