"""The PD KV connector: every rule of the prefill -> decode handoff, in the spirit of vLLM's
KVConnector (a half per side of the handoff).

- ``messages``: the handoff's messages, and the control plane's codec (it knows them too);
- ``pairing``: the gateway's side: which requests pair a decode and a prefill rank, and how a
  decode rank's destination becomes the prefill rank's request (no tensor library);
- ``decode``: the decode rank's side: reservation, deadlines kept alive by the prefill rank's
  progress, quarantine of pages a late write could still reach, fencing;
- ``prefill``: the prefill rank's side: per-layer KV writes started from the engine's layer
  hook, polling, the done message that fences the pages, progress to the decode ranks;
- ``outbox``: what a side sends through and counts.

The engine knows nothing of it (import-linter): a side drives the engine's façade
(dsinfer/engine/facade.py: ``kv_pages``, ``remote``, ``run_step``'s layer hook) and a transfer
backend (dsinfer/transfer), and the worker roles (dsinfer/workers) route messages to it.
This file imports nothing, so that the gateway can use ``pairing`` and ``messages`` without the
tensor side.
"""
