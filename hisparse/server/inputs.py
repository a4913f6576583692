"""From an OpenAI-shaped request to the engine's inputs: the checks that refuse what the
server cannot honour (a 400 naming the field), the prompts as token ids, the sampling
parameters and the output constraint. :class:`APIError` is the error every handler raises."""

from __future__ import annotations

import re

from hisparse.engine.async_engine import AsyncLLM
from hisparse.engine.sampling import SamplingParams, StructuredOutputsParams
from hisparse.server.http import clip
from hisparse.server.metrics import ServerMetrics

# request fields an engine ValueError may name first (the 400's param)
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop_token_ids",
                    "ignore_eos", "n", "stop", "logprobs", "top_logprobs", "model", "messages",
                    "prompt", "stream_options", "max_completion_tokens",
                    "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias",
                    "min_p", "min_tokens", "bad_words", "kv_transfer_params")
# request fields that carry an output constraint (at most one per request)
_CONSTRAINT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar", "structured_outputs")


class APIError(Exception):
    """An HTTP error in the OpenAI shape: ``status``, ``message``, the request field at fault
    (``param``, None when none is) and the error ``type``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type_


def _param_of(message: str, prompt_field: str) -> str | None:
    """The request field an engine ValueError names (its messages start with the field)."""
    m = re.match(r"\s*(?:prompt \d+: )?([a-z_]+)", message)
    if not m:
        return None
    word = m.group(1)
    if word in ("prompt_token_ids", "prompt", "text"):
        return prompt_field
    return word if word in _SAMPLING_FIELDS else None


def bad_request(e: ValueError, prompt_field: str, constraint_field: str | None = None) -> APIError:
    """The 400 of an engine ``ValueError``, its param the request field the message names
    (``prompt_field`` for the prompt; ``constraint_field``, the field the client used, for
    the engine's ``structured_outputs``)."""
    msg = str(e)
    if constraint_field is not None and msg.startswith("structured_outputs"):
        # the engine names its own field; the client sent another (response_format, ...)
        head, _, rest = msg.partition(":")
        return APIError(400, f"{constraint_field}{head[len('structured_outputs'):]}:{rest}",
                        constraint_field)
    return APIError(400, msg, _param_of(msg, prompt_field))


def constraint_field_of(req) -> str | None:
    """The request field that carries its output constraint (None: unconstrained); 400 when
    several do."""
    used = [f for f in _CONSTRAINT_FIELDS if getattr(req, f) is not None
            and not (f == "response_format" and req.response_format.type == "text")]
    if len(used) > 1:
        raise APIError(400, f"{used[1]}: only one output constraint per request (also got "
                       f"{used[0]})", used[1])
    return used[0] if used else None


def structured_outputs_of(req) -> StructuredOutputsParams | None:
    """The request's output constraint, from whichever field carries it."""
    field = constraint_field_of(req)
    if field is None:
        return None
    try:
        if field == "response_format":
            rf = req.response_format
            if rf.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise APIError(400, "response_format: type json_schema needs "
                               "json_schema.schema", field)
            return StructuredOutputsParams(json=rf.json_schema.schema_)
        if field == "structured_outputs":
            known = {"json", "json_object", "regex", "choice", "grammar"}
            extra = sorted(set(req.structured_outputs) - known)
            if extra:
                raise APIError(400, f"structured_outputs: unsupported key {extra[0]!r} "
                               f"(supported: {sorted(known)})", field)
            return StructuredOutputsParams(**req.structured_outputs)
        kind = field.removeprefix("guided_")
        return StructuredOutputsParams(**{kind: getattr(req, field)})
    except ValueError as e:
        raise APIError(400, f"{field}: {e}", field) from None


class ServerState:
    """What a request handler reads: the engine, the served model's name, the server's own
    tokenizer (None: token ids only), the metrics and the model's context length."""

    def __init__(self, engine: AsyncLLM, model_name: str, tokenizer, metrics: ServerMetrics):
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.max_model_len = engine.llm.max_model_len


def check_model(st: ServerState, model: str | None) -> None:
    if model is not None and model != st.model_name:
        raise APIError(404, f"model {clip(model, 100)!r} does not exist; this server serves "
                       f"{st.model_name!r}", "model", "not_found_error")


def check_max_tokens(st: ServerState, prompts: list[dict], max_tokens: int | None,
                     field: str) -> None:
    """An explicit ``max_tokens`` beyond the context a prompt leaves is a 400 naming the limit
    (as vLLM); a default one is cut to it. A prompt that leaves nothing is the engine's 400."""
    if max_tokens is None:
        return
    for p in prompts:
        n = len(p["prompt_token_ids"])
        if n < st.max_model_len and n + max_tokens > st.max_model_len:
            raise APIError(400, f"{field}: this model's maximum context length is "
                           f"{st.max_model_len} tokens and the prompt has {n}, so at most "
                           f"{st.max_model_len - n} can be generated; got {field}={max_tokens}",
                           field)


def check_common(st: ServerState, req) -> None:
    check_model(st, req.model)
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", "stream_options")
    if req.stop is not None:
        if any(not s for s in req.stop_strings()):
            raise APIError(400, "stop strings must not be empty", "stop")
        if st.tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer in the model directory; use "
                           "stop_token_ids", "stop")


def sampling_params(req, max_tokens: int, logprobs: int | None) -> SamplingParams:
    try:
        return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                              seed=req.seed, max_tokens=max_tokens,
                              stop_token_ids=list(req.stop_token_ids or []),
                              ignore_eos=req.ignore_eos, logprobs=logprobs,
                              skip_special_tokens=req.skip_special_tokens,
                              frequency_penalty=req.frequency_penalty,
                              presence_penalty=req.presence_penalty,
                              repetition_penalty=req.repetition_penalty,
                              logit_bias=req.logit_bias, min_p=req.min_p,
                              min_tokens=req.min_tokens, bad_words=req.bad_words,
                              structured_outputs=structured_outputs_of(req),
                              kv_transfer_params=req.kv_transfer_params)
    except ValueError as e:
        raise bad_request(e, "prompt") from None


def encode(st: ServerState, text: str, field: str, special: bool = True) -> dict:
    if st.tokenizer is None:
        raise APIError(400, "text prompts need a tokenizer in the model directory; send token "
                       "ids", field)
    try:
        ids = st.tokenizer.encode(text, add_special_tokens=special)
    except Exception as e:  # noqa: BLE001 - the tokenizer's own error
        raise APIError(400, f"{field}: the tokenizer failed: {e}", field) from None
    return {"prompt_token_ids": [int(t) for t in ids], "text": text}


def completion_prompts(st: ServerState, prompt) -> list[dict]:
    if isinstance(prompt, str):
        return [encode(st, prompt, "prompt")]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return [encode(st, p, "prompt") for p in prompt]
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": list(prompt), "text": None}]
    return [{"prompt_token_ids": list(p), "text": None} for p in prompt]


def chat_prompt(st: ServerState, chat: list, add_generation_prompt: bool,
                add_special_tokens: bool = False) -> dict:
    tok = st.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise APIError(400, "this model has no chat template (tokenizer_config.json "
                       "chat_template): use /v1/completions", "messages")
    messages = []
    for m in chat:
        content = m.content
        if isinstance(content, list):
            parts = [p.get("text", "") for p in content if p.get("type") == "text"]
            if len(parts) != len(content):
                raise APIError(400, "messages: only text content parts are supported",
                               "messages")
            content = "".join(parts)
        messages.append({"role": m.role, "content": content or ""})
    try:
        text = tok.apply_chat_template(messages, tokenize=False,
                                       add_generation_prompt=add_generation_prompt)
    except Exception as e:  # noqa: BLE001 - the template's own error
        raise APIError(400, f"messages: the chat template failed: {e}", "messages") from None
    return encode(st, text, "messages", special=add_special_tokens)
