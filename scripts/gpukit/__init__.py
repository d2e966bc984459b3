"""The GPU acceptance kit behind ``scripts/gpu-check`` (docs/gpu.md): independent stages, each run
in its own process with a time limit, each writing a JSON result that the kit gathers into one
JSON and one markdown summary."""
