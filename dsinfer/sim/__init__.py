"""Cluster performance model, simulator and planner for DeepSeek-V3-architecture deployments.

- :mod:`.hardware`: GPU datasheet figures (H800, H100, H200) and measured ceilings where they exist.
- :mod:`.kernels`: published kernel-level measurements (DeepGEMM, FlashMLA, FlashAttention-3, DeepEP)
  turned into time functions.
- :mod:`.shape`: the model dimensions (from the preset's config.json); weights and KV bytes per rank
  come from ``dsinfer.base.rank_shape.RankShape``, the memory plan's accounting.
- :mod:`.cost`: per-layer stage costs of prefill and decode steps (FLOPs, bytes, dispatch and
  combine volume) -> step time; :mod:`.schedule`: the compute/NIC streams of the two-micro-batch
  overlap schedules.
- :mod:`.experts`: synthetic expert popularity, the expert placement (the real EPLB of
  ``dsinfer.parallel``), per-rank expert load and dispatch fan-out.
- :mod:`.workload`: traffic profiles (day/night rate, prompt/output lengths, cache hits, SLO).
- :mod:`.deployment`: pool specifications (from `dsinfer serve` profiles) and the other assumptions.
- :mod:`.simulator`: discrete-event simulation of prefill and decode pools (:mod:`.pools`: their
  queues and steps), routed by the gateway's own balancers (``dsinfer.balancers``) fed with
  synthetic load reports; :mod:`.result`: what a run measured; :mod:`.analytic`: closed-form
  decode speed and stationary batch.
- :mod:`.planner`: pools per role for a load and SLO, a day/night schedule, checked in the simulator.
- :mod:`.cache`: ``SimCache``, the explicit memo of costly pure results (traffic calibration, expert
  placement, pool models) that a planner run or the report owns and passes down; nothing is kept in
  module globals.

Nothing here is fitted to the throughput figures it is compared with (benchmarks/sim_report.py).
"""
