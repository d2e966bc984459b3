"""The engine's requests by id: their sequences and prompt text until every choice finished."""

from __future__ import annotations

from dsinfer.base.tokenizer import Tokenizer
from dsinfer.engine.outputs import RequestOutput, build_output
from dsinfer.engine.sequence import Sequence


class RequestTable:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._requests: dict[str, tuple[list[Sequence], str | None]] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def add(self, request_id: str, seqs: list[Sequence], prompt: str | None) -> None:
        self._requests[request_id] = (seqs, prompt)

    def discard(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def collect(self, finished: list[Sequence]) -> list[RequestOutput]:
        """The outputs of the requests whose last choice is among ``finished`` (they leave)."""
        outputs = []
        for request_id in dict.fromkeys(seq.request_id for seq in finished):
            seqs, prompt = self._requests[request_id]
            if all(s.is_finished for s in seqs):
                del self._requests[request_id]
                outputs.append(build_output(request_id, prompt, seqs, self._tokenizer))
        return outputs
