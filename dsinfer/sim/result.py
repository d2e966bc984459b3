"""What one simulation measured (dsinfer/sim/simulator.py) and whether it meets the SLO."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from dsinfer.sim.workload import Slo

MAX_BACKLOG_GROWTH = 0.02


@dataclass
class SimResult:
    duration: float
    prefill_nodes: int
    decode_nodes: int
    requests: int = 0
    ttft: np.ndarray = field(default_factory=lambda: np.zeros(0))
    input_tokens: float = 0.0  # prompt tokens (cache hits included) whose prefill ended in the window
    computed_tokens: float = 0.0
    output_tokens: float = 0.0  # decode tokens produced in the window
    decode_presence: float = 0.0  # request-seconds in decode (running or waiting) in the window
    mean_batch: float = 0.0  # running requests per decode rank, time-averaged
    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_step_time: float = 0.0  # mean
    decode_step_time: float = 0.0
    prefill_attention_imbalance: float = 1.0
    prefill_expert_imbalance: float = 1.0
    decode_attention_imbalance: float = 1.0
    decode_expert_imbalance: float = 1.0
    preemptions: int = 0
    decode_arrivals: int = 0  # requests whose KV reached decode in the window
    decode_backlog_growth: int = 0  # waiting decode requests at the end of the window minus at its start

    @property
    def decode_overloaded(self) -> bool:
        """The waiting queue grew by more than ``MAX_BACKLOG_GROWTH`` of the window's arrivals: the
        pool falls behind (its per-user speed would keep falling past the window)."""
        return self.decode_backlog_growth > MAX_BACKLOG_GROWTH * max(self.decode_arrivals, 1)

    @property
    def ttft_p50(self) -> float:
        return float(np.percentile(self.ttft, 50, method="higher")) if self.ttft.size else 0.0

    @property
    def ttft_p90(self) -> float:
        return float(np.percentile(self.ttft, 90, method="higher")) if self.ttft.size else 0.0

    @property
    def tokens_per_user(self) -> float:
        return self.output_tokens / self.decode_presence if self.decode_presence > 0 else math.inf

    @property
    def input_per_node(self) -> float:
        return self.input_tokens / self.duration / self.prefill_nodes if self.prefill_nodes else 0.0

    @property
    def output_per_node(self) -> float:
        return self.output_tokens / self.duration / self.decode_nodes if self.decode_nodes else 0.0

    def meets(self, slo: Slo) -> bool:
        ok = True
        if self.prefill_nodes:
            ok &= self.ttft.size > 0 and self.ttft_p90 <= slo.ttft_p90_s
        if self.decode_nodes:
            ok &= self.tokens_per_user >= slo.min_tokens_per_s and not self.decode_overloaded
        return bool(ok)

    def summary(self) -> dict[str, float]:
        out = {
            "requests": self.requests,
            "prefill_nodes": self.prefill_nodes,
            "decode_nodes": self.decode_nodes,
        }
        if self.prefill_nodes:
            out |= {
                "ttft_p50_s": self.ttft_p50,
                "ttft_p90_s": self.ttft_p90,
                "input_tok_s_per_node": self.input_per_node,
                "computed_tok_s_per_node": self.computed_tokens / self.duration / self.prefill_nodes,
                "prefill_step_s": self.prefill_step_time,
                "prefill_attention_imbalance": self.prefill_attention_imbalance,
                "prefill_expert_imbalance": self.prefill_expert_imbalance,
            }
        if self.decode_nodes:
            out |= {
                "tokens_per_user_s": self.tokens_per_user,
                "output_tok_s_per_node": self.output_per_node,
                "decode_batch_per_rank": self.mean_batch,
                "decode_step_s": self.decode_step_time,
                "decode_attention_imbalance": self.decode_attention_imbalance,
                "decode_expert_imbalance": self.decode_expert_imbalance,
                "preemptions": self.preemptions,
                "decode_backlog_growth": self.decode_backlog_growth,
                "decode_arrivals": self.decode_arrivals,
            }
        return {k: float(v) for k, v in out.items()}
