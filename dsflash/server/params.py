"""Request schemas and their parameters: the pydantic bodies of the chat, completions and Anthropic
messages requests, and what their fields become (sampling parameters, stop strings, the reasoning effort,
the offered and forced tools, JSON mode), each refused with a 400 naming the field when out of range."""

from __future__ import annotations

import secrets
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dsflash.engine.json_mode import Node, SchemaError, compile_schema, schema_start
from dsflash.engine.sampling import SamplingParams
from dsflash.engine.tool_call import parameter_names
from dsflash.server.errors import ApiError
from dsflash.tokenizer import EOS_ID

REASONING_LEVELS = {"none": None, "minimal": 10, "low": 25, "medium": 50, "high": 75, "xhigh": 100, "max": 100}


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _text_is_unicode(cls, body: Any) -> Any:
        """JSON's `\\ud800` escapes decode to lone surrogates, which no UTF-8 text (nor the tokenizer)
        holds: refused here, named by field, before anything reads the text."""
        where = lone_surrogate(body)
        if where is not None:
            raise ApiError(400, f"{where or 'body'}: a lone UTF-16 surrogate is not text", where or "body")
        return body


def lone_surrogate(value: Any, where: str = "") -> str | None:
    """The path of the first string (key or value) in `value` that is not valid Unicode text, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        path = f"{where}[{k}]" if isinstance(k, int) else f"{where}.{k}" if where else str(k)
        if isinstance(k, str) and lone_surrogate(k) is not None:
            return path
        found = lone_surrogate(v, path)
        if found is not None:
            return found
    return None


class StreamOptions(_Body):
    include_usage: bool = False


class Sampling(_Body):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)  # vLLM's extension
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions: generation ends at EOS (unless ignore_eos) or at any of stop_token_ids, neither of
    # which may come before min_tokens tokens
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int = Field(0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=16)  # choice i samples with seed + i
    return_progress: bool = False  # llama.cpp's prompt_progress chunks while prefilling (streaming only)
    skip_special_tokens: bool = True  # vLLM's: special tokens (BOS, the role markers) left out of the text


class ChatRequest(Sampling):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    reasoning_effort: str | int | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(Sampling):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class AnthropicThinking(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class MessagesRequest(_Body):
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    max_tokens: int = Field(ge=1)
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    thinking: AnthropicThinking | None = None


class CountTokensRequest(MessagesRequest):
    max_tokens: int | None = Field(None, ge=1)  # not part of a count


def stop_list(stop: str | list[str] | None) -> list[str]:
    """The stop strings of a request: at most 4, none empty."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > 4:
        raise ApiError(400, "stop: at most 4 stop strings", "stop")
    if any(not s for s in stops):
        raise ApiError(400, "stop: stop strings must be non-empty", "stop")
    return stops


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    try:
        return tuple(sorted((int(k), float(v)) for k, v in (bias or {}).items()))
    except ValueError as e:
        raise ApiError(400, "logit_bias: keys must be token ids", "logit_bias") from e


def _end_ids(req: Sampling | MessagesRequest) -> tuple[int, ...]:
    ids = set(getattr(req, "stop_token_ids", None) or ())
    if not getattr(req, "ignore_eos", False):
        ids.add(EOS_ID)
    if any(i < 0 for i in ids):
        raise ApiError(400, "stop_token_ids: must be token ids", "stop_token_ids")
    return tuple(sorted(ids))


def json_mode(fmt: Any, field: str, forced_tools: tuple[str, ...] = ()) -> tuple[bool, Node | None]:
    """What a response format (OpenAI's response_format, the Responses API's text.format) asks for: (a JSON
    object?, the schema it follows). A schema outside the supported subset is refused, not ignored, and so
    is JSON output together with a forced tool call (the answer cannot be both)."""
    kind = fmt.get("type") if isinstance(fmt, dict) else fmt
    if kind in (None, "text"):
        return False, None
    if kind not in ("json_object", "json_schema"):
        raise ApiError(400, f"{field}: unknown type {kind!r}; one of text, json_object, json_schema", field)
    if forced_tools:
        raise ApiError(400, f"{field}: {kind} and a forced tool call exclude each other", field)
    node = None
    if kind == "json_schema":
        spec = fmt.get("json_schema", fmt)  # chat nests it under json_schema, Responses does not
        schema = spec.get("schema") if isinstance(spec, dict) else None
        try:
            node = compile_schema(schema, f"{field}.schema")
            schema_start(node)
        except SchemaError as e:
            raise ApiError(400, str(e), field) from e
    return True, node


def sampling_params(req: Sampling | MessagesRequest) -> SamplingParams:
    """The sampling parameters of a request (the fields it lacks at their neutral values)."""
    temperature = 1.0 if req.temperature is None else req.temperature
    seed = req.seed if getattr(req, "seed", None) is not None else secrets.randbits(63)
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
    try:
        return SamplingParams(temperature, req.top_p if req.top_p is not None else 1.0, top_k,
                              getattr(req, "min_p", None) or 0.0, seed,
                              getattr(req, "presence_penalty", None) or 0.0,
                              getattr(req, "frequency_penalty", None) or 0.0,
                              getattr(req, "repetition_penalty", None) or 1.0,
                              _logit_bias(getattr(req, "logit_bias", None)), getattr(req, "min_tokens", 0),
                              _end_ids(req))
    except ValueError as e:
        raise ApiError(400, str(e), str(e).split(" ")[0]) from e


def reasoning_effort(value: str | int | None, field: str = "reasoning_effort") -> tuple[bool | None, int | None]:
    """(thinking, effort) from OpenAI's reasoning_effort (a named level or an int 1..100), named `field` in
    errors: "none" turns thinking off, any other level on with that effort; None leaves both to the defaults."""
    if value is None:
        return None, None
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ApiError(400, f"{field}: must be a level name or an integer, not {type(value).__name__}", field)
    if isinstance(value, int):
        if not 1 <= value <= 100:
            raise ApiError(400, f"{field}: must be an integer in [1, 100] or a level name", field)
        return True, value
    if value not in REASONING_LEVELS:
        raise ApiError(400, f"{field}: unknown level {value!r}; one of {sorted(REASONING_LEVELS)}", field)
    effort = REASONING_LEVELS[value]
    return (False, None) if effort is None else (True, effort)


def anthropic_thinking(req: MessagesRequest) -> tuple[bool | None, int | None]:
    """(thinking, reasoning budget) from Anthropic's `thinking`: enabled needs budget_tokens, at least 1,024
    and below max_tokens (as Anthropic checks), which caps the reasoning; adaptive thinks uncapped; disabled
    does not; absent leaves it to the default."""
    t = req.thinking
    if t is None:
        return None, None
    if t.type == "disabled":
        return False, None
    if t.type == "adaptive":
        return True, None
    if t.budget_tokens is None:
        raise ApiError(400, "thinking.budget_tokens: Field required when thinking is enabled", "thinking.budget_tokens")
    if t.budget_tokens < 1024:
        raise ApiError(400, "thinking.budget_tokens: Input should be greater than or equal to 1024",
                       "thinking.budget_tokens")
    if req.max_tokens <= t.budget_tokens:
        raise ApiError(400, f"max_tokens must be greater than thinking.budget_tokens ({req.max_tokens} <= "
                            f"{t.budget_tokens})", "max_tokens")
    return True, t.budget_tokens


def offered_tools(tools: list[dict] | None, tool_choice: Any, schema_field: str = "function.parameters"
                  ) -> tuple[list[dict] | None, tuple[tuple[str, Node], ...]]:
    """The tools put in the prompt under `tool_choice` (OpenAI, Responses or Anthropic spelling, tools in
    OpenAI's form) and those of which one must be called, with their parameters' schemas: auto → all
    tools, nothing forced; none → no tools; required / any → all, one of them forced; a named tool → all,
    that one forced. A forced tool's schema outside json_mode's subset is refused, named as the request's
    `tools[i].<schema_field>`."""
    kind = tool_choice.get("type") if isinstance(tool_choice, dict) else tool_choice
    if kind in (None, "auto"):
        return tools, ()
    if kind == "none":
        return None, ()
    # (malformed tools are refused by encode_messages, which renders them next)
    named = [(i, t["function"]) for i, t in enumerate(tools or ()) if isinstance(t, dict)
             and isinstance(t.get("function"), dict)]
    names = tuple(f.get("name") for _, f in named)
    if kind in ("required", "any"):
        if not names:
            raise ApiError(400, f"tool_choice: {kind!r} needs at least one tool", "tool_choice")
        chosen = named
    elif kind in ("function", "tool") and isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        if function is not None and not isinstance(function, dict):
            raise ApiError(400, "tool_choice.function: must be an object with a name", "tool_choice.function")
        name = tool_choice.get("name") or (function or {}).get("name")
        if name not in names:
            raise ApiError(400, f"tool_choice: no tool named {name!r} among the tools", "tool_choice")
        chosen = [(i, f) for i, f in named if f.get("name") == name][:1]
    else:
        raise ApiError(400, f"tool_choice: {tool_choice!r} is not auto, none, required/any or a named tool",
                       "tool_choice")
    forced = []
    for i, f in chosen:
        where = f"tools[{i}].{schema_field}"
        try:
            node = compile_schema(f.get("parameters", {"type": "object"}), where)
            parameter_names(f.get("name"), node)
        except SchemaError as e:
            msg = str(e) if str(e).startswith(where) else f"{where}: {str(e).removeprefix('schema: ')}"
            raise ApiError(400, f"{msg} (a forced call's arguments follow its schema)", where) from e
        forced.append((f["name"], node))
    return tools, tuple(forced)
