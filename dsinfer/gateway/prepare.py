"""OpenAI request bodies -> validated prompts (token ids) and SamplingParams.

Everything a worker would refuse is refused here with a 400 in OpenAI's format, so bad input
never reaches the backend: types (pydantic, strict), the model name, sampling values (through
SamplingParams, whose ValueError names the field), token ids outside the vocabulary, empty
prompts, prompts that do not fit the context length, and requests whose KV no registered pool
could hold (the limits come from the pools' Register messages: ``Limits.capacity``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from dsinfer.base.sampling_params import SamplingParams
from dsinfer.base.tokenizer import ChatTemplateError, Tokenizer
from dsinfer.gateway.backend import Capacity
from dsinfer.gateway.errors import APIError, bad_request
from dsinfer.gateway.openai_api import ChatCompletionRequest, ChatMessage, CompletionRequest
from dsinfer.gateway.structured import request_grammar
from dsinfer.gateway.tool_parsers import ToolFormat
from dsinfer.gateway.tools import plan_tools

MAX_LOGPROBS = 20  # top-N logprobs per position, as vLLM's default max_logprobs
_TEMPLATE_RESERVED = ("messages", "add_generation_prompt", "bos_token", "eos_token", "pad_token")

_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "nullable"})

_UNION_MESSAGES = {
    "prompt": "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "stop must be a string or a list of strings",
}

RequestT = TypeVar("RequestT", bound=BaseModel)


@dataclass(frozen=True)
class Limits:
    model_name: str
    vocab_size: int
    max_n: int
    capacity: Capacity  # what the registered pools hold: max_model_len, KV pages
    max_token_chars: int | None = None  # the tokenizer's bound on one token's characters

    @property
    def max_model_len(self) -> int:
        return self.capacity.max_model_len


@dataclass
class Prepared:
    """A validated request: one job per prompt, each with ``params.n`` choices."""

    prompts: list[list[int]]
    prompt_texts: list[str]  # for echo
    params: SamplingParams
    stream: bool
    include_usage: bool
    include_stop_str: bool
    return_token_ids: bool  # logprob tokens as "token_id:<id>"
    echo: bool = False
    top_logprobs: int = 0  # chat: how many alternatives per token
    thinking: bool = False  # chat: the prompt opens the thinking (``reasoning_mode``)
    tool_format: ToolFormat | None = None  # chat: read tool calls from the output in this format
    echo_logprobs: bool = False  # completions: echo with logprobs: the prompt's tokens lead the logprobs
    echo_only: bool = False  # completions: echo with max_tokens 0: the one generated token is dropped
    show_prompt_logprobs: bool = True  # the request asked for prompt_logprobs (echo may ask for it)


def parse_body(cls: type[RequestT], body: bytes) -> RequestT:
    try:
        return cls.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e) from None


def validation_error(e: ValidationError) -> APIError:
    err = e.errors()[0]
    if err["type"] == "json_invalid":
        return bad_request(f"request body is not valid JSON: {err['msg'].removeprefix('Invalid JSON: ')}")
    # pydantic names the union member it tried ("str", "list[int]"...): not a place in the body
    loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p))]
    if not loc:
        return bad_request("request body must be a JSON object")
    if err["type"] == "missing":
        return bad_request(f"{'.'.join(loc)} is required", param=loc[0])
    if loc[0] in _UNION_MESSAGES:
        return bad_request(_UNION_MESSAGES[loc[0]], param=loc[0])
    return bad_request(f"{'.'.join(loc)}: {err['msg']}", param=loc[0])


def check_model(requested: str | None, limits: Limits) -> None:
    if requested is not None and requested != limits.model_name:
        raise APIError(
            404,
            f"the model {requested!r} does not exist; this server serves {limits.model_name!r}",
            param="model",
            code="model_not_found",
        )


def _check_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"{param}: token id {bad} is outside the vocabulary [0, {vocab_size})", param=param)


def _logit_bias(raw: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if raw is None:
        return None
    bias = {}
    for key, value in raw.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias: key {key!r} is not a token id", param="logit_bias") from None
        bias[token] = value
    _check_ids(list(bias), vocab_size, "logit_bias")
    return bias


def _refuse_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    if req.use_beam_search:
        raise bad_request("beam search is not supported", param="use_beam_search")


def _sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    limits: Limits,
    *,
    max_tokens: int | None,
    max_tokens_param: str,
    logprobs: int | None,
    logprobs_param: str,
    grammar: str | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    if req.n > limits.max_n or req.n < 1:
        raise bad_request(f"n must be in [1, {limits.max_n}], got {req.n}", param="n")
    for name, value in ((logprobs_param, logprobs), ("prompt_logprobs", req.prompt_logprobs)):
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise bad_request(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}", param=name)
    fields: dict[str, Any] = {
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "seed": req.seed,
    }
    fields = {k: v for k, v in fields.items() if v is not None}
    if fields.get("top_k", 0) >= limits.vocab_size:
        fields["top_k"] = 0  # keeping the whole vocabulary is "off"
    stop_ids = req.stop_token_ids or []
    _check_ids(stop_ids, limits.vocab_size, "stop_token_ids")
    try:
        return SamplingParams(
            n=req.n,
            stop=req.stop,
            stop_token_ids=stop_ids,
            ignore_eos=req.ignore_eos,
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_logprobs=req.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            logit_bias=_logit_bias(req.logit_bias, limits.vocab_size),
            min_tokens=req.min_tokens,
            grammar=grammar,
            **fields,
        )
    except ValueError as e:
        raise _params_error(str(e), max_tokens_param, logprobs_param) from None


def _params_error(message: str, max_tokens_param: str, logprobs_param: str) -> APIError:
    """SamplingParams' message starts with the field's name: that is the ``param``."""
    param = message.split(" ", 1)[0]
    if param == "max_tokens" and max_tokens_param != param:
        param, message = max_tokens_param, message.replace("max_tokens", max_tokens_param, 1)
    elif param == "logprobs" and logprobs_param != param:
        param, message = logprobs_param, message.replace("logprobs", logprobs_param, 1)
    return bad_request(message, param=param if param.isidentifier() else None)


def _check_chars(
    text: str, limits: Limits, param: str, max_tokens: int | None, max_tokens_param: str
) -> None:
    """Refuse, before tokenizing it, a text whose characters alone prove it too long: it has at
    least ``ceil(len(text) / max_token_chars)`` tokens (no token stands for more characters)."""
    per_token, limit = limits.max_token_chars, limits.max_model_len
    if per_token is None:
        return
    least, chars = -(-len(text) // per_token), len(text)
    if least >= limit:
        raise bad_request(
            f"the prompt has {chars} characters, so at least {least} tokens (a token stands for at most "
            f"{per_token} characters); this model's context length is {limit} tokens",
            param=param,
            code="context_length_exceeded",
        )
    if max_tokens is not None and least + max_tokens > limit:
        raise bad_request(
            f"this model's context length is {limit} tokens, but at least {least + max_tokens} were "
            f"requested (the prompt's {chars} characters are at least {least} tokens, a token standing for "
            f"at most {per_token} characters; {max_tokens} in {max_tokens_param}); lower {max_tokens_param}",
            param=max_tokens_param,
            code="context_length_exceeded",
        )


def _check_length(ids: list[int], params: SamplingParams, limits: Limits, max_tokens_param: str) -> None:
    _check_ids(ids, limits.vocab_size, "prompt")
    n, limit = len(ids), limits.max_model_len
    if n >= limit:
        raise bad_request(
            f"the prompt has {n} tokens; this model's context length is {limit} tokens "
            f"(the prompt must leave room for at least one generated token)",
            param="prompt",
            code="context_length_exceeded",
        )
    if params.max_tokens is not None and n + params.max_tokens > limit:
        raise bad_request(
            f"this model's context length is {limit} tokens, but {n + params.max_tokens} were requested "
            f"({n} in the prompt, {params.max_tokens} in {max_tokens_param}); lower {max_tokens_param}",
            param=max_tokens_param,
            code="context_length_exceeded",
        )
    refusal = limits.capacity.refusal(n, params.max_tokens)
    if refusal is not None:
        raise bad_request(
            f"{refusal}; lower {max_tokens_param} or shorten the prompt",
            param=max_tokens_param if params.max_tokens is not None else "prompt",
            code="kv_capacity_exceeded",
        )


def _stream_flags(req: CompletionRequest | ChatCompletionRequest) -> bool:
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
    return bool(req.stream_options and req.stream_options.include_usage)


def prepare_completion(req: CompletionRequest, tokenizer: Tokenizer, limits: Limits) -> Prepared:
    check_model(req.model, limits)
    _refuse_unsupported(req)
    if req.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of is only supported when equal to n", param="best_of")
    echo_only = req.echo and req.max_tokens == 0  # scoring: the prompt's logprobs, nothing generated
    echo_logprobs = req.echo and req.logprobs is not None
    prompt_logprobs = None
    if echo_logprobs and req.logprobs is not None:  # the prompt's logprobs lead the choice's
        prompt_logprobs = max(req.logprobs, req.prompt_logprobs or 0)
    params = _sampling_params(
        req,
        limits,
        max_tokens=1 if echo_only else req.max_tokens,
        max_tokens_param="max_tokens",
        logprobs=req.logprobs,
        logprobs_param="logprobs",
        grammar=request_grammar(req),
        prompt_logprobs=prompt_logprobs,
    )
    raw = req.prompt
    items: list[str] | list[list[int]]
    if isinstance(raw, str):
        items = [raw]
    elif raw and isinstance(raw[0], int):
        items = [raw]  # type: ignore[list-item]
    else:
        items = raw  # type: ignore[assignment]
    if not items or any(len(item) == 0 for item in items):
        raise bad_request("prompt must not be empty", param="prompt")
    prompts, texts = [], []
    for item in items:
        if isinstance(item, str):
            _check_chars(item, limits, "prompt", params.max_tokens, "max_tokens")
            ids = tokenizer.encode(item, add_special_tokens=req.add_special_tokens)
            texts.append(item)
        else:
            ids = list(item)
            _check_ids(ids, limits.vocab_size, "prompt")
            texts.append(tokenizer.decode(ids, skip_special_tokens=False) if req.echo else "")
        if not ids:
            raise bad_request("prompt must not be empty", param="prompt")
        _check_length(ids, params, limits, "max_tokens")
        prompts.append(ids)
    return Prepared(
        prompts=prompts,
        prompt_texts=texts,
        params=params,
        stream=req.stream,
        include_usage=_stream_flags(req),
        include_stop_str=req.include_stop_str_in_output,
        return_token_ids=req.return_tokens_as_token_ids,
        echo=req.echo,
        echo_logprobs=echo_logprobs,
        echo_only=echo_only,
        show_prompt_logprobs=req.prompt_logprobs is not None,
    )


def _message_dict(index: int, message: ChatMessage) -> dict[str, Any]:
    data = message.model_dump(exclude_none=True)
    if message.role == "developer":
        data["role"] = "system"
    if isinstance(message.content, list):
        parts = []
        for part in message.content:
            if part.type != "text" or part.text is None:
                raise bad_request(
                    f"messages.{index}.content: only text parts are supported, got {part.type!r}",
                    param="messages",
                )
            parts.append(part.text)
        data["content"] = "".join(parts)
    elif message.content is None:
        data["content"] = ""
    return data


EFFORTS = {
    "none": None,
    "minimal": "high",
    "low": "high",
    "medium": "high",
    "high": "high",
    "xhigh": "max",
    "max": "max",
}
_THINKING_KWARGS = ("thinking", "enable_thinking")


def reasoning_mode(req: ChatCompletionRequest) -> tuple[bool, str | None]:
    """(thinking, effort) a chat request asks for. Thinking: ``chat_template_kwargs``'
    ``thinking`` (vLLM's and SGLang's DeepSeek switch) or ``enable_thinking``, else whether a
    ``reasoning_effort`` other than "none" is given. The effort, for templates that have one
    (DeepSeek-V4: "high" or "max"), as DeepSeek's API maps OpenAI's levels: up to "high" is
    "high", "xhigh" and "max" are "max"."""
    kwargs = req.chat_template_kwargs or {}
    raw = req.reasoning_effort if req.reasoning_effort is not None else kwargs.get("reasoning_effort")
    param = "reasoning_effort" if req.reasoning_effort is not None else "chat_template_kwargs"
    if raw is not None and raw not in EFFORTS:
        raise bad_request(f"reasoning_effort must be one of {', '.join(EFFORTS)}, got {raw!r}", param=param)
    switch = next((kwargs[k] for k in _THINKING_KWARGS if k in kwargs), None)
    if switch is not None and not isinstance(switch, bool):
        raise bad_request("chat_template_kwargs.thinking must be true or false", param="chat_template_kwargs")
    thinking = switch if switch is not None else raw is not None and EFFORTS[raw] is not None
    effort = EFFORTS[raw] if thinking and raw is not None else None
    return thinking, effort


def render_chat(
    req: ChatCompletionRequest,
    tokenizer: Tokenizer,
    limits: Limits,
    tools: list[dict[str, Any]] | None = None,
    max_tokens: int | None = None,
    max_tokens_param: str = "max_tokens",
    mode: tuple[bool, str | None] | None = None,
) -> list[int]:
    """``mode``: the request's ``reasoning_mode`` when the caller has it already."""
    if not req.messages:
        raise bad_request("messages must not be empty", param="messages")
    kwargs = dict(req.chat_template_kwargs or {})
    reserved = [k for k in (*_TEMPLATE_RESERVED, "tools") if k in kwargs]
    if reserved:
        raise bad_request(f"chat_template_kwargs must not set {reserved[0]!r}", param="chat_template_kwargs")
    if tools:
        kwargs["tools"] = tools
    thinking, effort = mode or reasoning_mode(req)
    kwargs.pop("reasoning_effort", None)  # the template sees the mapped effort only
    if thinking:
        kwargs["thinking"] = True
    if effort is not None:
        kwargs["reasoning_effort"] = effort
    messages = [_message_dict(i, m) for i, m in enumerate(req.messages)]
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt, **kwargs
        )
    except ChatTemplateError as e:
        raise bad_request(f"cannot apply the chat template: {e.reason}", param="messages") from None
    _check_chars(text, limits, "messages", max_tokens, max_tokens_param)
    return tokenizer.encode(text, add_special_tokens=False)


def prepare_chat(
    req: ChatCompletionRequest, tokenizer: Tokenizer, limits: Limits, tool_parser: str = "deepseek-v3"
) -> Prepared:
    check_model(req.model, limits)
    _refuse_unsupported(req)
    mode = reasoning_mode(req)
    thinking = mode[0]
    tools = plan_tools(req, tool_parser, tokenizer.token_to_id, thinking)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    top = req.top_logprobs or 0
    uses_new_name = req.max_completion_tokens is not None
    max_tokens_param = "max_completion_tokens" if uses_new_name else "max_tokens"
    params = _sampling_params(
        req,
        limits,
        max_tokens=req.max_completion_tokens if uses_new_name else req.max_tokens,
        max_tokens_param=max_tokens_param,
        logprobs=top if req.logprobs else None,
        logprobs_param="top_logprobs",
        grammar=request_grammar(
            req, tools.grammar if tools else None, tools is not None and tools.with_response_format
        ),
    )
    if tools is not None and tools.format is not None and tools.format.needs_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)
    template_tools = tools.template_tools if tools else None
    ids = render_chat(req, tokenizer, limits, template_tools, params.max_tokens, max_tokens_param, mode)
    if not ids:
        raise bad_request("the rendered chat prompt is empty", param="messages")
    _check_length(ids, params, limits, max_tokens_param)
    return Prepared(
        prompts=[ids],
        prompt_texts=[""],
        params=params,
        stream=req.stream,
        include_usage=_stream_flags(req),
        include_stop_str=req.include_stop_str_in_output,
        return_token_ids=req.return_tokens_as_token_ids,
        top_logprobs=top,
        thinking=thinking,
        tool_format=tools.format if tools else None,
    )
