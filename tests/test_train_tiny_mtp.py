"""scripts/train_tiny_mtp.py: the chained streams see what the engine's MTP cache holds, and a short
run rewrites the MTP layer's tensors only (the main model's are written back bit for bit)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
SHIPPED = Path(__file__).resolve().parent.parent / "configs" / "models" / "tiny-chat"


def test_a_chained_query_sees_the_first_stream_up_to_its_origin_and_the_chain_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(SCRIPTS))
    from train_tiny_mtp import _chain_mask

    mask = _chain_mask(torch.zeros(1, 4, dtype=torch.long), 3)[0, 0]
    n = 4
    # stream 3, index 1 (position 3): stream 1 at indices 0-1 (positions 0-1), stream 2 at index 1
    # (position 2), itself; nothing else
    row = mask[2 * n + 1]
    assert row.nonzero().flatten().tolist() == [0, 1, n + 1, 2 * n + 1]
    assert mask[:n, :n].equal(torch.ones(n, n, dtype=torch.bool).tril())  # stream 1: causal
    assert not mask[:n, n:].any()  # the first stream never sees the chain
    # packed conversations do not see each other
    two = _chain_mask(torch.tensor([[0, 0, 1, 1]]), 2)[0, 0]
    assert two[n + 2].nonzero().flatten().tolist() == [2, n + 2]


@pytest.mark.system
def test_a_short_run_rewrites_only_the_mtp_layer(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "train_tiny_mtp.py"),
            *("--out", str(out), "--steps", "2", "--rows", "2", "--length", "64", "--eval-size", "1"),
            *("--log-every", "1", "--warmup", "1"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "before:" in run.stdout and "after:" in run.stdout
    shipped, written = load_file(SHIPPED / "model.safetensors"), load_file(out / "model.safetensors")
    assert shipped.keys() == written.keys()
    mtp = "model.layers.4."
    for name, tensor in shipped.items():
        assert written[name].dtype == tensor.dtype, name
        if not name.startswith(mtp) or name.endswith(("embed_tokens.weight", "shared_head.head.weight")):
            assert torch.equal(written[name], tensor), name
    assert not torch.equal(written[mtp + "eh_proj.weight"], shipped[mtp + "eh_proj.weight"])
