"""A pool over two nodes, as two launchers on this machine (``--nnodes 2 --node-rank 0|1``, a
rank each, one torch.distributed group through ``--dist-init-addr``): beside a gateway and a
prefill pool, each a process of its own, the decode pool answers concurrent requests (both of its
data-parallel ranks get some) with the offline engine's tokens, for DeepSeek-V3 and for
DeepSeek-V4 (an expert-parallel pool over the nodes: each node's rank holds its expert slots)."""

from __future__ import annotations

import contextlib
import os
import secrets
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dsinfer import LLM, SamplingParams
from dsinfer.base.cluster_secret import SECRET_ENV
from dsinfer.base.processes import free_port
from harness.checkpoints import BuiltCheckpoint
from harness.metrics import metric_value, wait_kv_free, wait_workers
from harness.server import Server, dsinfer_command, gateway, running, wait_until
from harness.v4_checkpoints import add_v4_mtp, build_v4
from tests.test_v4_elastic import ENGINE, WORKERS

pytestmark = pytest.mark.system

MAX_TOKENS = 12


@pytest.mark.parametrize("family", ["v3", "v4"])
def test_decode_pool_over_two_nodes(family: str, tiny_ckpt: BuiltCheckpoint, tmp_path: Path) -> None:
    if family == "v3":
        model = tiny_ckpt.path
        prompts = [[5 + i, 17, 23 + 2 * i, 9, 41, 3 + i] * (2 + i) for i in range(6)]
    else:
        pytest.importorskip("transformers")
        model = tmp_path / "v4"
        build_v4("flash_like", model, with_tokenizer=True)
        add_v4_mtp(model, 0.3)
        prompts = [[(7 * i + 13 * j) % 4000 + 2 for j in range(30 + 20 * i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    offline = LLM(
        str(model), dtype="float32", kv_cache_memory="16MiB", max_num_seqs=16, max_num_batched_tokens=64
    )
    expected = [list(o.outputs[0].token_ids) for o in offline.generate(prompts, params, use_tqdm=False)]
    secret = secrets.token_hex(32)
    env = {**os.environ, SECRET_ENV: secret}
    with contextlib.ExitStack() as stack:
        gw = stack.enter_context(gateway(tmp_path / "gateway.log", secret, ["--model", str(model)]))
        assert gw.control is not None
        pool = ["--model", str(model), *ENGINE, "--gateway-addr", gw.control]
        init = f"127.0.0.1:{free_port()}"
        decode = ["--role", "decode", "--pool-size", "2", "--nnodes", "2", "--dist-init-addr", init]
        roles = [("prefill", ["--role", "prefill"])]
        roles += [(f"decode{node}", [*decode, "--node-rank", str(node)]) for node in (0, 1)]
        for name, flags in roles:
            server = Server(dsinfer_command("serve", *flags, *pool), 0, tmp_path / f"{name}.log")
            stack.enter_context(running(server, 60, env=env, ready=lambda: True))
        wait_workers(
            gw.base_url, WORKERS, 180, lambda: "".join(p.read_text()[-2000:] for p in tmp_path.glob("*.log"))
        )
        client = gw.openai_client(timeout=120)
        name = client.models.list().data[0].id

        def complete(prompt: list[int]) -> list[int]:
            done = client.completions.create(
                model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
                extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
            )  # fmt: skip
            return [int(t.removeprefix("token_id:")) for t in done.choices[0].logprobs.tokens]

        with ThreadPoolExecutor(len(prompts)) as threads:
            assert list(threads.map(complete, prompts)) == expected

        def idle_ranks() -> list[str]:  # a rank's counters reach the gateway with its next load report
            metrics = gw.metrics()
            return [
                rank
                for rank in ("decode/0/0", "decode/0/1")
                if metric_value(metrics, "dsinfer_worker_prompt_tokens_total", worker=rank) <= 0
            ]

        wait_until(lambda: not idle_ranks(), "both nodes' decode ranks to report decoded prompts", 10)
        wait_kv_free(gw.base_url)
