"""Stage ``env``: what this machine has. GPU, driver, torch, CUDA, triton, NCCL, nvcc; which of
deep_gemm, flash_mla and deep_ep import (and which API generation); the kernel backends
``select_ops`` picks; the Python packages dsinfer and the kit need. Fails only when a package
dsinfer needs is missing (later stages would fail for that reason)."""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
import shutil
import subprocess

from .common import StageContext, StageResult

NEEDED = (  # import name -> what needs it
    ("torch", "dsinfer"),
    ("safetensors", "dsinfer"),
    ("pydantic", "dsinfer"),
    ("tokenizers", "dsinfer"),
    ("jinja2", "dsinfer"),
    ("yaml", "dsinfer"),
    ("tqdm", "dsinfer"),
    ("numba", "dsinfer"),
    ("zmq", "dsinfer servers"),
    ("msgspec", "dsinfer servers"),
    ("fastapi", "dsinfer gateway"),
    ("uvicorn", "dsinfer gateway"),
    ("prometheus_client", "dsinfer gateway"),
    ("llguidance", "dsinfer constrained decoding"),
    ("cryptography", "dsinfer control plane"),
    ("psutil", "dsinfer workers"),
    ("numpy", "dsinfer"),
    ("dsinfer.engine.llm", "stages parity, server, v3-engine (the engine with all its imports)"),
    ("dsinfer.gateway.app", "stage server"),
    ("triton", "dsinfer kernels"),
    ("pytest", "stage gpu-tests"),
    ("transformers", "stages gpu-tests, parity"),
    ("openai", "stage server"),
    ("httpx", "stage server"),
    ("harness.server", "stages server, parity, adapters (the harness, installed with dsinfer)"),
)
TRANSFER = ("nixl_cu13", "nixl_cu12")  # dsinfer's NIXL backend imports one of these
IMPORT_NAMES = {
    "pyyaml": "yaml",
    "pyzmq": "zmq",
    "prometheus-client": "prometheus_client",
}  # distribution -> module


def _command(argv: list[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[-1] if out else None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _imports(name: str) -> str | None:
    """None when ``import name`` works, else why not."""
    try:
        importlib.import_module(name)
    except Exception as exc:  # a broken CUDA extension raises more than ImportError
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return None


def external_libraries() -> dict[str, str]:
    """deep_gemm / flash_mla / deep_ep: "absent (...)" or what the adapters make of them."""
    from dsinfer.ops.external import DeepGemmAdapter, flash_mla_api
    from dsinfer.parallel.deepep import missing_buffer_api

    out = {}
    for name in ("deep_gemm", "flash_mla", "deep_ep"):
        try:
            module = importlib.import_module(name)
        except Exception as exc:
            out[name] = f"absent ({type(exc).__name__})"
            continue
        version = getattr(module, "__version__", None) or _version(name.replace("_", "-")) or "?"
        try:
            if name == "deep_gemm":
                detail = f"API {DeepGemmAdapter(module).api}"
            elif name == "flash_mla":
                detail = f"API {flash_mla_api(module)}"
            else:
                detail = missing_buffer_api(module) or "legacy Buffer API present"
        except ImportError as exc:
            detail = str(exc)
        out[name] = f"{version}: {detail}"
    return out


def run(ctx: StageContext, result: StageResult) -> None:
    import torch

    from dsinfer.ops import select_ops

    f = result.figures
    f["python"] = platform.python_version()
    f["torch"] = torch.__version__
    f["torch_cuda"] = torch.version.cuda
    f["triton"] = _version("triton")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        f["gpu"] = torch.cuda.get_device_name(0)
        f["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        f["sms"] = props.multi_processor_count
        f["memory_gib"] = round(props.total_memory / 2**30, 1)
        f["gpus"] = torch.cuda.device_count()
        f["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    f["driver"] = _command(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    f["nvcc"] = _command(["nvcc", "--version"])
    f["nvshmem"] = _version("nvidia-nvshmem-cu13") or _version("nvidia-nvshmem-cu12")
    f["external"] = external_libraries()
    transfer = {name: _imports(name) or "ok" for name in TRANSFER}
    f["nixl"] = transfer
    missing = {name: why for name, _ in NEEDED if (why := _imports(name)) is not None}
    f["missing_packages"] = {name: f"{why} (needed by {dict(NEEDED)[name]})" for name, why in missing.items()}
    ops = select_ops(ctx.device)
    f["ops_backends"] = dict(ops.backends)
    result.check("dsinfer's and the kit's packages import", not missing, ", ".join(missing) or "all")
    result.check("a NIXL package imports", any(v == "ok" for v in transfer.values()), str(transfer))
    if not ctx.cpu_smoke:
        result.check("a CUDA device", torch.cuda.is_available())
    where = f.get("gpu", "CPU")
    result.summary = (
        f"{where} {f.get('capability', '')}, torch {f['torch']}, triton {f['triton']}, NCCL {f.get('nccl', '-')}; "
        + "; ".join(f"{k} {v.split(' (')[0]}" for k, v in f["external"].items())
    )
