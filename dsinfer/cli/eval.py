"""``dsinfer eval``: exact-match accuracy of the built-in tasks, offline or against an OpenAI endpoint.

Offline (default) the engine flags choose the model and mode (``--speculative-mtp`` adds the MTP
acceptance rate); ``--endpoint URL`` sends the same chat messages to a running server instead
(dsinfer's gateway, vLLM's OpenAI server, ...). ``--json FILE`` writes the whole report, the
generated token ids included.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dsinfer.cli.engine_args import add_engine_args, engine_args_from
from dsinfer.cli.errors import UsageError
from dsinfer.engine.args import parse_size
from dsinfer.evals.runner import Client, EndpointClient, EndpointError, OfflineClient, run_eval
from dsinfer.evals.tasks import HELD_OUT_SIZE, TASKS

KV_CACHE_MEMORY = "256MiB"


def add_eval_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    group = parser.add_argument_group("evaluation")
    group.add_argument(
        "--tasks", default=",".join(TASKS), help=f"comma-separated (default: all of {', '.join(TASKS)})"
    )
    group.add_argument(
        "--limit", type=int, default=HELD_OUT_SIZE, help="held-out questions per task (default: %(default)s)"
    )
    group.add_argument(
        "--endpoint", default=None, help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1"
    )
    group.add_argument("--served-model-name", default=None, help="with --endpoint (default: its first model)")
    group.add_argument("--concurrency", type=int, default=16, help="with --endpoint: requests in flight")
    group.add_argument("--json", dest="json_path", type=Path, default=None, help="write the report here")


def _tasks(spec: str) -> list[str]:
    tasks = [t.strip() for t in spec.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise UsageError(
            f"--tasks: unknown task(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(TASKS)}"
        )
    return tasks


def run_eval_command(args: argparse.Namespace) -> int:
    tasks = _tasks(args.tasks)
    if not 1 <= args.limit <= HELD_OUT_SIZE:
        raise UsageError(f"--limit must be between 1 and {HELD_OUT_SIZE}, got {args.limit}")
    if args.concurrency < 1:
        raise UsageError(f"--concurrency must be at least 1, got {args.concurrency}")
    client: Client
    llm = None
    if args.endpoint is not None:
        try:
            client = EndpointClient(args.endpoint, args.served_model_name, args.concurrency)
        except EndpointError as e:
            raise UsageError(str(e)) from None
    else:
        from dsinfer.engine.llm import LLM

        engine_args = engine_args_from(args)
        if engine_args.kv_cache_memory is None and engine_args.kv_cache_memory_fraction is None:
            engine_args = engine_args.model_copy(update={"kv_cache_memory": parse_size(KV_CACHE_MEMORY)})
        llm = LLM.from_engine_args(engine_args)
        client = OfflineClient(llm)
    try:
        report = run_eval(client, tasks, args.limit)
    except EndpointError as e:
        raise UsageError(str(e)) from None
    finally:
        if llm is not None:
            llm.engine.close()
    print(f"evaluation of {report.client}, {args.limit} held-out questions per task, greedy")
    print(report.table())
    if args.json_path is not None:
        args.json_path.write_text(json.dumps(report.to_json(), indent=1) + "\n")
    return 0
