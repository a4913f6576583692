"""OpenAI-compatible request and response models (the subset hisparse serves).

Requests declare every field the server implements and refuse any other (``extra="forbid"``:
a 400 naming the field), so a field a client sends is honoured or refused, never ignored. A
field given as JSON ``null`` counts as not given. :data:`UNSUPPORTED` names the OpenAI / vLLM
fields known not to be implemented, with the reason the error gives.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Known request fields this server does not implement -> why (the 400's message).
UNSUPPORTED: dict[str, str] = {
    "suffix": "insertion (suffix) is not supported",
    "tools": "tool calling is not supported",
    "tool_choice": "tool calling is not supported",
    "parallel_tool_calls": "tool calling is not supported",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
}


def unsupported_message(field: str) -> str:
    why = UNSUPPORTED.get(field, "this server does not implement this field")
    return f"{field}: {why}"


class _Strict(BaseModel):
    """Unknown fields are a 400 naming them; an explicit ``null`` is the same as absent."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _drop_absent(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class _Request(_Strict):

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False        # vLLM's extension: token ids in each choice
    skip_special_tokens: bool = True      # vLLM's extension: special tokens out of the text
    user: str | None = None               # end-user id: written to the access log only
    # sampling (hisparse.engine.sampling.SamplingParams checks the ranges)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    min_p: float = 0.0
    min_tokens: int = 0
    bad_words: list[str] | None = None
    # structured output: one of these (vLLM's names)
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # vLLM's disaggregation protocol (issue 23): in a request, and in a prefill's response
    kv_transfer_params: dict[str, Any] | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False    # vLLM's extension: usage in every chunk too


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False                    # True: a 400 (prompt echo is not supported)
    best_of: int | None = None            # > 1: a 400 (only n independent samples)


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    add_generation_prompt: bool = True


class TokenizeRequest(_Strict):
    """vLLM's ``/tokenize``: ``prompt`` (text) or ``messages`` (chat template), not both.
    ``add_special_tokens`` defaults to True for a prompt, False for messages (as vLLM)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "hisparse"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


_Request.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()
