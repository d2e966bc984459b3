"""DeepSeek-V4 through the Triton kernels its ops dispatch to on a GPU, on CPU under
``TRITON_INTERPRET=1`` in a fresh interpreter (as tests/test_kernels_gemm.py explains;
``python -m tests.test_kernels_v4_model`` prints the JSON of check results).

The same tiny checkpoint (harness/v4_checkpoints.py: sliding, CSA with its indexer, HCA) loaded
twice: once on the torch references, once with the compressor's pooling (``pool_windows``), the
attention core with its sink (``sparse_mla_decode``, the sink applied from its LSE) and the
indexer over the compressed keys (``indexer_topk``: V3.2's lightning-indexer kernel over the
entries' pages, each query a sequence of the entries it may see) on the Triton kernels. One
sequence whose entries are dense, and two whose entries live in a pool's pages, prompts far past
the window and the compression rates: the final hidden states agree within float32 rounding, and
every kernel ran.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_kernels_gemm import run_checks, subprocess_checks

pytestmark = pytest.mark.system


def _counted(fn: Callable[..., Any], name: str, calls: Counter[str]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return fn(*args, **kwargs)

    return wrapper


def _models(directory: Path) -> tuple[Any, Any, Counter[str]]:
    import dsinfer.kernels as kernels

    from dsinfer.model.v4_loader import load_v4
    from dsinfer.ops import select_ops
    from dsinfer.ops.indexer import indexer_topk_with

    reference_ops = select_ops("cpu", prefer="torch", quiet=True)
    calls: Counter[str] = Counter()
    kernel_ops = dataclasses.replace(
        reference_ops,
        pool_windows=_counted(kernels.pool_windows, "pool_windows", calls),
        sparse_mla_decode=_counted(kernels.sparse_mla_decode, "sparse_mla_decode", calls),
        indexer_topk=_counted(indexer_topk_with(kernels.indexer_logits), "indexer_topk", calls),
        backends={**reference_ops.backends, "indexer": "triton"},
    )
    return load_v4(directory, reference_ops), load_v4(directory, kernel_ops), calls


def check_v4_forward_through_the_kernels() -> None:
    from dsinfer.model.v4_paged import SequenceStates
    from harness.v4_checkpoints import build_v4

    with tempfile.TemporaryDirectory() as tmp:
        build_v4("flash_like", Path(tmp))
        reference, kernel, calls = _models(Path(tmp))
    config = reference.config
    g = torch.Generator().manual_seed(9)
    prompt = torch.randint(0, config.vocab_size, (64,), generator=g)
    expected = reference.forward(prompt, reference.new_state())
    got = kernel.forward(prompt, kernel.new_state())
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4, msg="dense entries")
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in (40, 100)]
    outputs = []
    for model in (reference, kernel):
        states = SequenceStates(config, 8, 256, torch.float32, torch.device("cpu"))
        seqs = [states.for_step(f"s{i}", 0, [2 * i, 2 * i + 1]) for i in range(2)]
        outputs.append(model.forward_many(torch.cat(prompts), seqs, [len(p) for p in prompts]))
    torch.testing.assert_close(outputs[1], outputs[0], atol=2e-4, rtol=2e-4, msg="paged entries")
    assert min(calls.values()) > 0 and set(calls) == {"pool_windows", "sparse_mla_decode", "indexer_topk"}, (
        calls
    )


CHECKS = (check_v4_forward_through_the_kernels,)
results, test_kernel_check = subprocess_checks("tests.test_kernels_v4_model", CHECKS)


if __name__ == "__main__":
    print(json.dumps(run_checks(CHECKS)))
