"""One stage in its own process: ``python -m scripts.gpukit.run_stage CONTEXT_JSON``. Writes the
stage's result.json whatever happens (an exception becomes a failed result with its traceback)."""

from __future__ import annotations

import importlib
import sys
import time
import traceback

from .common import StageContext, StageResult, log
from .stages import BY_NAME


def main(argv: list[str]) -> int:
    ctx = StageContext.from_json(argv[0])
    result = StageResult(ctx.name, autosave=ctx.out)
    start = time.monotonic()
    try:
        module = importlib.import_module(f"scripts.gpukit.{BY_NAME[ctx.name].module}")
        module.run(ctx, result)
    except Exception as exc:  # the stage failed; the kit goes on with the next one
        result.error = "".join(traceback.format_exception(exc))[-4000:]
        log(f"{ctx.name}: {type(exc).__name__}: {exc}")
    result.seconds = round(time.monotonic() - start, 1)
    result.write(ctx.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
