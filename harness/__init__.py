"""The harness: everything that drives dsinfer from outside, shared by benchmarks/, tests/ and the
GPU kit (scripts/gpukit) and imported as a package (docs/architecture.md):

- ``server``: ``dsinfer serve`` (all-in-one, a gateway alone) or any other server as real
  processes on free ports, ready within a bound, stopped on every exit path; its processes;
- ``clients`` (streamed completions over httpx, with timings and retries) and ``streams``
  (the official ``openai`` client in threads, with every token id);
- ``metrics``: the gateway's ``/metrics`` per worker, and the CPU and memory of processes;
- ``provenance`` (machine, git commit, command line), ``results`` (percentiles, tables, files)
  and ``progress`` (one line per event);
- ``rank_pool`` (engine-level rank processes of a benchmark), ``children`` (a child spoken to in
  JSON lines), ``played_rank`` (a rank played over the control protocol);
- ``checkpoints`` and ``hf_reference``: tiny DeepSeek checkpoints and transformers' answers for
  them; ``tiny_tokenizer``: the tiny models' tokens and chat template; ``kernels``: what the
  kernel benchmarks share (shapes, GPU timer, error measures).

It may import dsinfer; dsinfer never imports it (an import contract in pyproject.toml). Process
basics (free ports, spawning, stopping) are dsinfer's own (dsinfer/base/processes.py).
"""
