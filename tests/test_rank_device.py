"""Where a pool rank runs and how its collectives reach the others: one GPU per local rank, NCCL
for GPU ranks and gloo for CPU ranks, host tensors reduced in place on either, the EP backend
named in the engine args."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dsinfer.engine.args import EngineArgs
from dsinfer.workers.rank import process_group_backend, rank_device


@pytest.mark.parametrize(
    ("device", "local_rank", "gpus", "expected"),
    [
        ("auto", 0, 0, "cpu"),
        ("auto", 3, 0, "cpu"),
        ("auto", 1, 2, "cuda:1"),
        ("cuda", 0, 1, "cuda:0"),
        ("cuda", 7, 8, "cuda:7"),
        ("cuda:3", 5, 8, "cuda:3"),  # named by the user: kept
        ("cpu", 2, 8, "cpu"),
    ],
)
def test_rank_device(device: str, local_rank: int, gpus: int, expected: str) -> None:
    assert rank_device(device, local_rank, gpus) == expected


def test_rank_device_needs_a_gpu_per_local_rank() -> None:
    with pytest.raises(ValueError, match="local rank 2 needs GPU 2, but 2 are visible"):
        rank_device("cuda", 2, 2)


def test_engine_args_name_the_ep_backend() -> None:
    assert EngineArgs().ep_backend == "auto" and EngineArgs(ep_backend="torch").ep_backend == "torch"
    with pytest.raises(ValueError, match="ep_backend must be one of auto, deepep, torch, got 'nccl'"):
        EngineArgs(ep_backend="nccl")


def test_process_group_backend() -> None:
    assert process_group_backend("cpu") == "gloo"
    assert process_group_backend("cuda:0") == "nccl"


REDUCE = """
import sys, torch, torch.distributed as dist
from dsinfer.parallel.ep import all_reduce_in_place
rank, store = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
t = torch.tensor([rank + 1.0, 10.0 * rank])
assert all_reduce_in_place(t, "sum", None) is t and t.tolist() == [3.0, 10.0], t
t = torch.tensor([rank + 1, rank])
assert all_reduce_in_place(t, "min", None).tolist() == [1, 0]
try:
    all_reduce_in_place(t, "mean", None)
except ValueError as e:
    assert "unknown reduce op 'mean'" in str(e)
else:
    raise AssertionError("mean accepted")
dist.destroy_process_group()
print("ok")
"""


def test_all_reduce_in_place_on_gloo(tmp_path: Path) -> None:
    store = tmp_path / "store"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", REDUCE, str(rank), str(store)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0 and out.strip().endswith("ok"), out


def test_explicit_cuda_device_becomes_current(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--device cuda:N`` outside a pool rank: the engine makes it the current CUDA device, so
    graphs, Triton launches and DeepGEMM's stream do not run on device 0."""
    import torch

    from dsinfer.engine.device import bind_device

    chosen: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    for name in ("cpu", "cuda", "cuda:3"):
        bind_device(torch.device(name))
    assert chosen == [torch.device("cuda:3")]
