"""Run the held-out questions (dsinfer.evals.tasks) through a model and score them.

Two clients answer the same chat messages greedily: ``OfflineClient`` through the offline ``LLM``
API (the chat template rendered by the checkpoint's tokenizer), ``EndpointClient`` through any
OpenAI-compatible server's ``/v1/chat/completions`` (dsinfer's gateway or vLLM's server), with
``return_tokens_as_token_ids`` so that the generated token ids come back too. The report holds
exact match per task, the mean prompt length per task, throughput, and, offline with MTP, the
draft acceptance rate and mean accepted length (tokens per target forward).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from dsinfer.base.sampling_params import SamplingParams
from dsinfer.evals.tasks import Question, held_out, score, well_formed

if TYPE_CHECKING:  # the engine (torch and its kernels) loads only when an offline client is made
    from dsinfer.engine.llm import LLM

MAX_ANSWER_TOKENS = 64  # the longest reply (a multiplication thought through) is about 45 tokens, plus eos


@dataclass
class Reply:
    text: str
    token_ids: list[int]  # generated ids, eos excluded
    prompt_tokens: int


@dataclass
class MTPStats:
    drafts_proposed: int
    drafts_accepted: int
    verifications: int  # sequence-steps that verified drafts

    @property
    def acceptance_rate(self) -> float:
        return self.drafts_accepted / self.drafts_proposed if self.drafts_proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification yields per sequence: 1 + accepted drafts per verification."""
        return 1.0 + self.drafts_accepted / self.verifications if self.verifications else 0.0


class Client(Protocol):
    name: str

    def answer(self, questions: Sequence[Question]) -> list[Reply]: ...

    def mtp_stats(self) -> MTPStats | None:
        """Drafts since the client was made (None: no MTP or not observable)."""
        ...


class OfflineClient:
    def __init__(self, llm: LLM, name: str = "dsinfer offline") -> None:
        self.llm, self.name = llm, name
        self.tokenizer = llm.get_tokenizer()
        self.eos = set(self.tokenizer.eos_token_ids)
        stats = self._stats()
        self.start = (stats.drafts_proposed, stats.drafts_accepted, stats.draft_verifications)

    def _stats(self):
        return self.llm.engine.scheduler.stats

    def prompt_ids(self, question: Question) -> list[int]:
        text = self.tokenizer.apply_chat_template(question.messages(), add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def answer(self, questions: Sequence[Question]) -> list[Reply]:
        prompts = [self.prompt_ids(q) for q in questions]
        params = SamplingParams(temperature=0.0, max_tokens=MAX_ANSWER_TOKENS)
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        replies = []
        for prompt, out in zip(prompts, outputs, strict=True):
            ids = [t for t in out.outputs[0].token_ids if t not in self.eos]
            replies.append(Reply(self.tokenizer.decode(ids, skip_special_tokens=True), ids, len(prompt)))
        return replies

    def mtp_stats(self) -> MTPStats | None:
        if not self.llm.engine.args.speculative_mtp:
            return None
        stats = self._stats()
        return MTPStats(
            stats.drafts_proposed - self.start[0],
            stats.drafts_accepted - self.start[1],
            stats.draft_verifications - self.start[2],
        )


class EndpointError(RuntimeError):
    """The server answered with an error or not at all; the message says which request and why."""


class EndpointClient:
    """Greedy chat completions against ``base_url`` (…/v1), ``concurrency`` requests in flight."""

    def __init__(
        self, base_url: str, model: str | None = None, concurrency: int = 16, timeout: float = 300
    ) -> None:
        self.base_url = base_url.rstrip("/")
        if not self.base_url.endswith("/v1"):
            self.base_url += "/v1"
        self.timeout = timeout
        self.model = model or self._first_model()
        self.concurrency = concurrency
        self.name = f"{self.base_url} ({self.model})"

    def _request(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base_url + path, data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            raise EndpointError(f"{self.base_url}{path}: HTTP {e.code}: {e.read()[:500]!r}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            raise EndpointError(f"{self.base_url}{path}: {e}") from None

    def _first_model(self) -> str:
        models = self._request("/models").get("data") or []
        if not models:
            raise EndpointError(f"{self.base_url}/models lists no model")
        return str(models[0]["id"])

    def _one(self, question: Question) -> Reply:
        body = {
            "model": self.model,
            "messages": question.messages(),
            "temperature": 0,
            "max_tokens": MAX_ANSWER_TOKENS,
            "logprobs": True,
            "return_tokens_as_token_ids": True,
        }
        result = self._request("/chat/completions", body)
        choice = result["choices"][0]
        content = (choice.get("logprobs") or {}).get("content") or []
        ids = [int(item["token"].removeprefix("token_id:")) for item in content]
        if choice.get("finish_reason") == "stop" and ids:
            ids.pop()  # the eos that ended the reply (no stop strings are sent)
        usage = result.get("usage") or {}
        return Reply(choice["message"].get("content") or "", ids, int(usage.get("prompt_tokens", 0)))

    def answer(self, questions: Sequence[Question]) -> list[Reply]:
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(self._one, questions))

    def mtp_stats(self) -> MTPStats | None:
        return None


@dataclass
class TaskResult:
    task: str
    correct: int
    total: int
    mean_prompt_tokens: float
    wrong: list[dict[str, str]] = field(default_factory=list)  # first few: prompt tail, expected, got
    well_formed: int = 0  # replies of the answer's form, right or wrong (tasks.well_formed)

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0


@dataclass
class EvalReport:
    client: str
    tasks: list[TaskResult]
    seconds: float
    requests: int
    output_tokens: int
    mtp: MTPStats | None
    token_ids: dict[str, list[list[int]]]  # per task, per question: the generated ids

    def accuracy(self) -> dict[str, float]:
        return {t.task: t.accuracy for t in self.tasks}

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["accuracy"] = self.accuracy()
        out["output_tokens_per_s"] = self.output_tokens / self.seconds if self.seconds else 0.0
        if self.mtp is not None:
            out["mtp"] |= {
                "acceptance_rate": self.mtp.acceptance_rate,
                "mean_accepted_length": self.mtp.mean_accepted_length,
            }
        return out

    def table(self) -> str:
        lines = [
            "| task | exact match | questions | well-formed | mean prompt tokens |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {t.task} | {t.accuracy:.1%} | {t.correct}/{t.total} | {t.well_formed}/{t.total} | "
            f"{t.mean_prompt_tokens:.0f} |"
            for t in self.tasks
        ]
        lines.append("")
        lines.append(
            f"{self.requests} requests, {self.output_tokens} output tokens in {self.seconds:.1f} s: "
            f"{self.output_tokens / max(self.seconds, 1e-9):.0f} output tok/s, "
            f"{self.requests / max(self.seconds, 1e-9):.1f} requests/s"
        )
        if self.mtp is not None:
            lines.append(
                f"MTP: {self.mtp.drafts_accepted}/{self.mtp.drafts_proposed} drafts accepted "
                f"({self.mtp.acceptance_rate:.1%}), mean accepted length {self.mtp.mean_accepted_length:.2f}"
            )
        return "\n".join(lines)


def run_eval(client: Client, tasks: Sequence[str], limit: int, keep_wrong: int = 5) -> EvalReport:
    """The first ``limit`` held-out questions of each task, all sent at once."""
    questions = [q for task in tasks for q in held_out(task)[:limit]]
    start = time.monotonic()
    replies = client.answer(questions)
    seconds = time.monotonic() - start
    results, token_ids = [], {}
    for task in tasks:
        pairs = [(q, r) for q, r in zip(questions, replies, strict=True) if q.task == task]
        wrong = [
            {"prompt_end": q.prompt[-40:], "expected": q.answer, "got": r.text}
            for q, r in pairs
            if not score(q, r.text)
        ]
        prompt_tokens = sum(r.prompt_tokens for _, r in pairs) / max(len(pairs), 1)
        formed = sum(well_formed(q, r.text) for q, r in pairs)
        results.append(
            TaskResult(task, len(pairs) - len(wrong), len(pairs), prompt_tokens, wrong[:keep_wrong], formed)
        )
        token_ids[task] = [r.token_ids for _, r in pairs]
    output_tokens = sum(len(r.token_ids) for r in replies)
    return EvalReport(
        client.name, results, seconds, len(questions), output_tokens, client.mtp_stats(), token_ids
    )
