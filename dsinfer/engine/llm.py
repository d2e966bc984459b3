"""The offline API: ``LLM(model=...).generate(prompts, sampling_params)``, as vLLM users know it."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from dsinfer.base.sampling_params import SamplingParams
from dsinfer.engine.args import EngineArgs
from dsinfer.engine.engine import LLMEngine
from dsinfer.engine.outputs import RequestOutput

Prompt = str | list[int]
log = logging.getLogger("dsinfer.engine")


class LLM:
    def __init__(
        self, model: str | None = None, *, load_format: str = "auto", dtype: str = "auto", **engine_args: Any
    ) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, load_format=load_format, dtype=dtype, **engine_args))
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        return cls(**args.model_dump())

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Every prompt is validated before any is queued."""
        batch = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(batch))
        requests = []
        for i, prompt in enumerate(batch):
            token_ids = self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            requests.append(
                (f"offline-{next(self._ids)}", token_ids, prompt if isinstance(prompt, str) else None)
            )
            if not token_ids or prompt == "":
                raise ValueError(f"prompt {i} is empty")
        added = []
        try:
            for (request_id, token_ids, text), p in zip(requests, params, strict=True):
                self.engine.add_request(request_id, token_ids, p, prompt=text)
                added.append(request_id)
        except ValueError:
            for request_id in added:
                self.engine.abort_request(request_id)
            raise
        return self._run(added, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        try:
            with tqdm(
                total=len(request_ids), desc="Requests", unit="req", dynamic_ncols=True, disable=not use_tqdm
            ) as bar:
                while self.engine.has_unfinished_requests():
                    for output in self.engine.step():
                        results[output.request_id] = output
                        bar.update()
        except BaseException:
            for request_id in request_ids:
                if request_id not in results:
                    self.engine.abort_request(request_id)
            raise
        log.info("%s", self.engine.stats_line())
        return [results[r] for r in request_ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    for i, p in enumerate(prompts):
        if not isinstance(p, str) and not (isinstance(p, list) and all(isinstance(t, int) for t in p)):
            raise ValueError(f"prompt {i} must be a string or a list of token ids")
    return prompts


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"sampling_params has {len(params)} entries for {n} prompts")
    return params
