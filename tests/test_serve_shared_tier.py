"""The disk tier shared by every rank of a server, through real processes: two colocated pools of
one rank over one ``--kv-disk-cache-dir``. A prompt computed on one pool is written behind to the
directory; that rank is killed with kill -9; the same prompt then runs on the other pool (which
never saw it) or on the killed pool restarted (its memory gone): either way its whole cached
prefix comes from the disk, the dead rank's pages, and the answer is the first one, token for
token."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import openai
import pytest

from harness.checkpoints import BuiltCheckpoint
from harness.metrics import healthy, metric_value, parse_metrics, series
from harness.server import serve, wait_until

pytestmark = pytest.mark.system

PAGE = 64
PROMPT = [(7 * i) % 200 + 10 for i in range(5 * PAGE + 20)]  # 5 full pages cached, the rest computed
ENGINE = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--kv-host-cache-size", "0"]


def _prompt_tokens(text: str) -> dict[str, float]:
    return series(parse_metrics(text), "prompt_tokens")


def test_a_page_another_rank_computed_survives_its_death(tiny_ckpt: BuiltCheckpoint, tmp_path: Path) -> None:
    directory = tmp_path / "shared-kv"
    args = ["--model", str(tiny_ckpt.path), *ENGINE, "--colocated", "--decode-pools", "2"]
    with serve([*args, "--kv-disk-cache-dir", str(directory)], tmp_path) as server:
        wait_until(lambda: len(healthy(parse_metrics(server.metrics()))) == 2, "both pools up", 120)
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=60, max_retries=0)

        def ask() -> list[str]:
            reply = client.completions.create(
                model=tiny_ckpt.path.name,
                prompt=PROMPT,
                max_tokens=12,
                temperature=0,
                logprobs=1,
                extra_body={"ignore_eos": True},
            )
            assert reply.choices[0].logprobs is not None
            return list(reply.choices[0].logprobs.tokens or [])

        first = ask()
        wait_until(lambda: any(_prompt_tokens(server.metrics()).values()), "the prompt in a load report", 10)
        computed_on = [w for w, n in _prompt_tokens(server.metrics()).items() if n > 0]
        assert len(computed_on) == 1, computed_on
        wait_until(lambda: len(list(directory.glob("[0-9a-f]*"))) >= 5, "pages written behind to disk", 30)
        pool = int(computed_on[0].split("/")[1])
        (victim,) = server.rank_pids("colocated", pool=pool)
        os.kill(victim, signal.SIGKILL)
        wait_until(lambda: computed_on[0] not in healthy(parse_metrics(server.metrics())), "rank gone", 60)

        assert ask() == first  # on the other pool, or on the killed one restarted: memory empty

        def hits() -> tuple[float, float, float]:
            text = server.metrics()
            return (
                metric_value(text, "dsinfer_prefix_cache_hit_tokens_total", tier="disk"),
                metric_value(text, "dsinfer_prefix_cache_hit_tokens_total", tier="memory"),
                metric_value(text, "dsinfer_kv_tier_pages_loaded_total", tier="disk"),
            )

        wait_until(lambda: hits()[0] > 0, "the serving rank's next load report", 10)
        assert hits() == (5 * PAGE, 0, 5)
