"""The soak drill: steady streaming load on a running server while its processes are killed.

Open-loop load: request ``i`` is sent at ``i / rate`` s, a greedy stream of one of ``prompts``
prompts, by a client that retries a refused or dropped request before its first token as the
OpenAI client does. Every ``fault_every`` s after the server is ready again, one fault, in turn:
kill -9 of a random rank, kill -9 of every rank of a random pool, kill -9 of the gateway, SIGTERM
to every rank of a random pool (a drain). Each request ends one of four ways: completed with the
text an undisturbed run gave, completed with other text (a defect), an error (counted by why),
or hung (no end within ``hang_after`` s). After the load: the KV pages still held, and every
process's resident memory over time (``Memory``), by what the process is (its rank's worker name,
``gateway``, ``launcher decode/0``...), so that restarted processes continue one series.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import psutil

from harness.clients import Stream, client_for, completion_body, stream_completion
from harness.metrics import healthy, kv_in_use, scrape
from harness.server import Server, rank_spec

FAULTS = ("rank", "pool", "gateway", "drain")
# PD with two prefill pools and two decode pools of two ranks (EP2), the built-in model
TOPOLOGY = ["--prefill-pools", "2", "--decode-pools", "2", "--decode-pool-size", "2"]


@dataclass(frozen=True)
class SoakPlan:
    duration: float  # seconds of load
    rate: float  # requests sent per second
    fault_every: float  # seconds from the server's recovery to the next fault
    max_tokens: int = 24
    prompts: int = 32
    retries: int = 2  # before the first token, as the OpenAI client (max_retries=2)
    hang_after: float = 300.0  # a request with no end this long after it was sent is hung
    recover_timeout: float = 180.0  # a fault the server is not ready again after is a failure
    memory_every: float = 2.0  # seconds between resident-memory samples
    seed: int = 0
    model: str = "tiny-chat"


@dataclass
class Fault:
    at: float  # seconds since the load started
    kind: str
    target: str
    pids: list[int]
    recovered_after: float | None = None  # seconds until /ready answered again


@dataclass
class Outcome:
    index: int
    prompt: int
    sent: float  # seconds since the load started
    verdict: str  # identical, different, error, hung
    why: str = ""
    attempts: int = 0


@dataclass
class SoakResult:
    outcomes: list[Outcome]
    faults: list[Fault]
    kv_after: dict[str, float]  # worker -> share of its KV pages still held after the load
    memory: dict[str, list[tuple[float, float]]]  # process -> (seconds, MiB) samples
    seconds: float

    def verdicts(self) -> Counter[str]:
        return Counter(o.verdict for o in self.outcomes)

    def errors(self) -> Counter[str]:
        return Counter(o.why for o in self.outcomes if o.verdict == "error")


def prompt_texts(count: int) -> list[str]:
    """``count`` distinct prompts (greedy: each has one undisturbed text)."""
    return [f"Question {i}: what is {12 + i} + {7 * i % 50}?\nAnswer:" for i in range(count)]


def error_kind(error: str) -> str:
    """An error without its request ids and numbers, so that alike errors count together."""
    return re.sub(r"\b[0-9a-f]{8,}\b|\d+(\.\d+)?", "N", error)[:160]


# Processes -------------------------------------------------------------------------------------
def labelled_pids(server: Server) -> dict[str, int]:
    """What each process of the server is -> its pid: ranks by worker name, the rest by role
    (launchers by role and pool)."""
    out: dict[str, int] = {"supervisor": server.pid}
    for proc in server.processes():
        with contextlib.suppress(psutil.Error):
            argv = proc.cmdline()
            spec = rank_spec(argv)
            if spec is not None:
                pool = spec["pool"]
                out[f"rank {pool['role']}/{pool['pool_id']}/{spec['rank']}"] = proc.pid
            elif "--role" in argv:
                role = argv[argv.index("--role") + 1]
                pool_id = argv[argv.index("--pool-id") + 1] if "--pool-id" in argv else "0"
                out["gateway" if role == "gateway" else f"launcher {role}/{pool_id}"] = proc.pid
    return out


def _pools(server: Server) -> dict[tuple[str, int], list[int]]:
    pools: dict[tuple[str, int], list[int]] = {}
    for pid, spec in server.ranks():
        pools.setdefault((spec["pool"]["role"], spec["pool"]["pool_id"]), []).append(pid)
    return pools


def inflict(server: Server, kind: str, rng: random.Random) -> tuple[str, list[int]]:
    """One fault of ``kind`` on a random target -> (what was hit, the pids signalled)."""
    if kind == "gateway":
        target, pids, sig = "gateway", server.pids().get("gateway", []), signal.SIGKILL
    else:
        pools = _pools(server)
        if not pools:
            return "no rank", []
        role, pool = rng.choice(sorted(pools))
        if kind == "rank":
            pid = rng.choice(pools[role, pool])
            spec = dict(server.ranks()).get(pid, {})
            target, pids, sig = f"rank {role}/{pool}/{spec.get('rank', '?')}", [pid], signal.SIGKILL
        else:
            target, pids = f"pool {role}/{pool}", pools[role, pool]
            sig = signal.SIGKILL if kind == "pool" else signal.SIGTERM
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return target, pids


# The drill -------------------------------------------------------------------------------------
class Soak:
    def __init__(self, server: Server, plan: SoakPlan, say: Callable[[str], None]) -> None:
        self.server, self.plan, self.say = server, plan, say
        self.rng = random.Random(plan.seed)
        self.prompts = prompt_texts(plan.prompts)
        self.expected: list[str] = []
        self.memory: dict[str, list[tuple[float, float]]] = {}
        self.faults: list[Fault] = []
        self.start = 0.0
        self.loading = True
        self.workers: set[str] = set()  # every worker, healthy before the first fault
        self.processes: set[str] = set()  # every process (``labelled_pids``) before the first fault

    def body(self, prompt: int) -> dict[str, Any]:
        return completion_body(self.prompts[prompt], self.plan.max_tokens, model=self.plan.model)

    async def references(self, client: httpx.AsyncClient) -> None:
        """The undisturbed text of every prompt (before any fault)."""
        streams = await asyncio.gather(
            *(self._stream(client, i, retries=5) for i in range(len(self.prompts)))
        )
        failed = [s.error for s in streams if s.error]
        if failed:
            raise RuntimeError(f"the undisturbed run failed: {failed[0]}")
        self.expected = [s.text for s in streams]

    async def _stream(self, client: httpx.AsyncClient, prompt: int, retries: int) -> Stream:
        return await stream_completion(client, self.server.base_url, self.body(prompt), retries=retries)

    async def one(self, client: httpx.AsyncClient, index: int) -> Outcome:
        prompt = index % len(self.prompts)
        sent = time.monotonic() - self.start
        try:
            s = await asyncio.wait_for(self._stream(client, prompt, self.plan.retries), self.plan.hang_after)
        except asyncio.TimeoutError:
            return Outcome(index, prompt, sent, "hung", f"no end after {self.plan.hang_after:g} s")
        if s.error is not None:
            return Outcome(index, prompt, sent, "error", error_kind(s.error), s.attempts)
        verdict = "identical" if s.text == self.expected[prompt] else "different"
        return Outcome(
            index, prompt, sent, verdict, "" if verdict == "identical" else repr(s.text[:80]), s.attempts
        )

    async def load(self, client: httpx.AsyncClient) -> list[Outcome]:
        tasks = []
        total = int(self.plan.duration * self.plan.rate)
        for index in range(total):
            await asyncio.sleep(max(0.0, self.start + index / self.plan.rate - time.monotonic()))
            tasks.append(asyncio.create_task(self.one(client, index)))
            if index % max(1, int(60 * self.plan.rate)) == 0:
                self.say(f"load: {index}/{total} requests sent, {sum(t.done() for t in tasks)} ended")
        self.loading = False
        self.say(f"load: all {total} sent; waiting for the last to end")
        return list(await asyncio.gather(*tasks))

    async def inflict_faults(self) -> None:
        turn = 0
        while True:
            await asyncio.sleep(self.plan.fault_every)
            if not self.loading:
                return
            kind = FAULTS[turn % len(FAULTS)]
            turn += 1
            target, pids = inflict(self.server, kind, self.rng)
            fault = Fault(time.monotonic() - self.start, kind, target, pids)
            self.faults.append(fault)
            self.say(f"fault {len(self.faults)}: {kind} -> {target} (pids {pids})")
            fault.recovered_after = await self._recovered(fault)
            self.say(f"fault {len(self.faults)}: ready again after {fault.recovered_after:.1f} s")

    async def _recovered(self, fault: Fault) -> float:
        """Seconds until the processes hit are replaced and every worker is healthy again."""
        deadline = time.monotonic() + self.plan.recover_timeout
        while time.monotonic() < deadline:
            now = labelled_pids(self.server)
            replaced = self.processes <= set(now) and not set(now.values()) & set(fault.pids)
            with contextlib.suppress(httpx.HTTPError):
                if replaced and self.workers <= healthy(
                    await asyncio.to_thread(scrape, self.server.base_url)
                ):
                    return time.monotonic() - self.start - fault.at
            await asyncio.sleep(0.5)
        raise TimeoutError(f"not ready {self.plan.recover_timeout:g} s after {fault.kind} -> {fault.target}")

    async def sample_memory(self) -> None:
        while True:
            now = time.monotonic() - self.start
            for label, pid in labelled_pids(self.server).items():
                with contextlib.suppress(psutil.Error):
                    self.memory.setdefault(label, []).append(
                        (now, psutil.Process(pid).memory_info().rss / 2**20)
                    )
            await asyncio.sleep(self.plan.memory_every)

    async def run(self) -> SoakResult:
        async with client_for(
            int(self.plan.rate * self.plan.hang_after) + 16, timeout=self.plan.hang_after
        ) as client:
            await self.references(client)
            self.workers = healthy(await asyncio.to_thread(scrape, self.server.base_url))
            self.processes = set(labelled_pids(self.server))
            self.say(
                f"undisturbed texts of {len(self.prompts)} prompts recorded, {len(self.workers)} workers; load starts"
            )
            self.start = time.monotonic()
            sampler = asyncio.create_task(self.sample_memory())
            faults = asyncio.create_task(self.inflict_faults())
            try:
                outcomes = await self.load(client)
                await faults
            finally:
                faults.cancel()
            seconds = time.monotonic() - self.start
            kv = await self._kv_after()
            await asyncio.sleep(self.plan.memory_every * 3)  # memory once the load is over
            sampler.cancel()
        return SoakResult(outcomes, self.faults, kv, self.memory, seconds)

    async def _kv_after(self, timeout: float = 60.0) -> dict[str, float]:
        """KV still held once the load ended, waited on for ``timeout`` s (transfers and aborts
        settle)."""
        deadline = time.monotonic() + timeout
        held: dict[str, float] = {}
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                held = kv_in_use(await asyncio.to_thread(scrape, self.server.base_url))
                if not held:
                    return {}
            await asyncio.sleep(1.0)
        return held


def growth(samples: list[tuple[float, float]], since: float) -> float | None:
    """Relative growth of resident memory from ``since`` on: the median of the last tenth of the
    samples over the median of the first tenth, minus 1 (None with too few samples)."""
    window = [mib for t, mib in samples if t >= since]
    if len(window) < 20:
        return None
    tenth = max(1, len(window) // 10)
    first, last = sorted(window[:tenth])[tenth // 2], sorted(window[-tenth:])[tenth // 2]
    return last / first - 1.0


def run_soak(server: Server, plan: SoakPlan, say: Callable[[str], None]) -> SoakResult:
    return asyncio.run(Soak(server, plan, say).run())
