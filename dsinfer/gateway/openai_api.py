"""OpenAI API request and response bodies (with vLLM's extensions where noted).

Requests validate in strict mode: a JSON string is never read as a number, a float never as an
integer. Unknown fields are ignored, as vLLM does; fields that would change the result but are
not supported are declared so that the gateway can refuse them (``best_of``, ``suffix``, the
legacy ``functions``...). Every request body is a model here, so the served OpenAPI schema
documents it.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

Prompt = str | list[str] | list[int] | list[list[int]]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Request):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None  # not supported: refused
    structural_tag: str | None = None  # not supported: refused


class _SamplingFields(_Request):
    """Fields the two endpoints share (OpenAI's, then vLLM's extensions)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool = False
    min_tokens: int = 0
    use_beam_search: bool = False  # not supported: refused when true
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's earlier names for structured_outputs' fields
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None  # not supported
    best_of: int | None = None  # only best_of == n
    add_special_tokens: bool = True  # vLLM: add bos to text prompts


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    type: str
    text: str | None = None


class FunctionCallIn(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    name: str
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    reasoning_content: str | None = None


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema (an object with no properties if absent)
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # "auto" with tools, else "none"
    parallel_tool_calls: bool = True
    functions: list[dict[str, Any]] | None = None  # legacy: refused (use tools)
    function_call: str | dict[str, Any] | None = None  # legacy: refused (use tool_choice)
    add_generation_prompt: bool = True  # vLLM
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM: extra variables for the template
    reasoning_effort: str | None = None  # OpenAI: none, minimal, low, medium, high, xhigh; DeepSeek: max


# Responses ---------------------------------------------------------------------------------------
class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class PromptLogprob(_Response):
    logprob: float
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


def _now() -> int:
    return int(time.time())


class _Completion(_Response):
    """A response body or stream chunk in OpenAI's field order; subclasses narrow ``object`` and
    ``choices`` in place."""

    id: str
    object: str
    created: int = Field(default_factory=_now)
    model: str
    choices: list[Any]
    usage: Usage | None = None


class CompletionResponse(_Completion):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(_Response):
    content: list[ChatLogprob] | None = None


class FunctionCallOut(_Response):
    name: str
    arguments: str


class ToolCallOut(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class _Sparse(_Response):
    """Only the fields a stream chunk carries appear in it."""

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_Sparse):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Sparse):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class _ChatChoiceCommon(_Response):
    index: int
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatChoice(_ChatChoiceCommon):
    message: ChatResponseMessage


class ChatCompletionResponse(_Completion):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    prompt_logprobs: PromptLogprobs | None = None  # vLLM: of the one prompt, at the response level


class ChatDelta(_Sparse):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(_ChatChoiceCommon):
    delta: ChatDelta


class ChatCompletionChunk(_Completion):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    prompt_logprobs: PromptLogprobs | None = None  # in the first chunk with choice 0's first tokens


class CompletionChunk(CompletionResponse):
    """OpenAI streams completions in the response's own shape."""


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "dsinfer"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]
