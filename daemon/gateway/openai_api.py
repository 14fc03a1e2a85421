"""OpenAI request bodies -> the daemon's `generate` messages (docs/protocol.md
§3.2), and errors in OpenAI's shape.

The gateway checks what it must to build a message: the shapes, against the
pydantic models of schemas.py (which also make /openapi.json), and the OpenAI
fields ridge does not have. The daemon checks the values (ranges, limits, the
vocabulary) and its error becomes the HTTP error. Fields ridge has no use for
(`user`, `metadata`, `store`, ...) are ignored, as vLLM and llama-server do;
fields that would change the output and that ridge cannot honour are a 400."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from ..transport.sharing import http_salt
from .dialects import OPENAI, Dialect, DialectError
from .errors import ApiError, bad  # noqa: F401 (the gateway's modules import them from here too)
from .images import from_url, joined
from .schemas import FORMS, ChatCompletionRequest, CompletionRequest, Sampling

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat runs to the context's end


# daemon error code -> (HTTP status, OpenAI error type)
_STATUS = {"busy": (429, "rate_limit_error"), "too_many_requests": (429, "rate_limit_error"),
           "shutting_down": (503, "service_unavailable_error"), "unavailable": (503, "service_unavailable_error"),
           "timeout": (503, "service_unavailable_error"), "internal": (500, "server_error"),
           "duplicate_id": (500, "server_error"), "model_not_found": (404, "not_found_error"),
           "model_load_failed": (500, "server_error")}


def from_daemon(code: str, message: str, reply: dict | None = None) -> ApiError:
    """A daemon `error` (or the client's own `unavailable`/`timeout`) -> the HTTP error."""
    status, type_ = _STATUS.get(code, (400, "invalid_request_error"))
    param = None
    head = message.split(" ", 1)[0]
    if head.startswith("params.") or head in ("prompt", "messages", "prompt_token_ids"):
        param = head.removeprefix("params.")
    elif code == "model_not_found":
        param = "model"
    retry = (reply or {}).get("retry_after")
    if status == 503 and retry is None:
        retry = 5.0 if code == "shutting_down" else 1.0
    return ApiError(status, message, type_, param, code, retry)


# -- reading bodies ----------------------------------------------------------------------------
M = TypeVar("M", bound=BaseModel)


def _where(loc: tuple) -> str:
    """pydantic's location -> `messages[0].content`."""
    out = ""
    for part in loc:
        if part not in FORMS:
            out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def parsed(model: type[M], body: dict) -> M:
    """The body as `model`; a 400 naming the first field it gets wrong."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False, include_input=False, include_context=False)[0]
        where = _where(err["loc"])
        raise bad(f"{where}: {err['msg']}" if where else err["msg"],
                  str(err["loc"][0]) if err["loc"] else None) from None


@dataclass
class Generation:
    """One OpenAI request, as the daemon `generate`s it takes (one per prompt)."""
    prompts: list[dict]  # each one of {"prompt": str}, {"token_ids": [...]}, {"messages": [...]}: the clients' words
    params: dict  # the daemon's params (§3.2)
    stream: bool = False
    include_usage: bool = False
    top_logprobs: int | None = None  # None: no logprobs; else the alternatives to show per token
    n: int = 1


def ceiling(given: int, limit: int | None) -> int:
    """A client's max_tokens, a ceiling as the HTTP APIs mean it: clients ask for more than a small
    model's context holds (Claude Code asks 32000), and get what the context leaves, with the finish
    reason saying it ran out (`length`). limit: the daemon's limits.max_tokens (docs/protocol.md §4),
    which the daemon refuses to see exceeded; the room left after the prompt it fits itself. A count
    below 1 is left for the daemon to refuse."""
    return min(given, limit) if limit and given > limit else given


def dialect_params(dialect: Dialect, req, defaults: bool = True) -> dict:
    """The declared fields a body gives, in the daemon's names (dialects.py); a value the API's
    form cannot carry is a 400 naming its field."""
    try:
        return dialect.params(lambda name: getattr(req, name), defaults)
    except DialectError as e:
        raise bad(e.message, e.field) from None


def _sampling(req: Sampling, max_tokens: int | None, given: int | None,
              limit: int | None = None) -> tuple[dict, int]:
    """The sampling fields both endpoints share -> (daemon params, n). max_tokens: the default;
    given: the body's (chat has two names for it), a ceiling up to limit (the daemon's)."""
    p: dict = {}
    if given is not None:
        max_tokens = ceiling(given, limit)
    if max_tokens is not None:
        p["max_tokens"] = max_tokens
    p.update(dialect_params(OPENAI, req))
    if req.min_tokens and not (p.get("ignore_eos") and not p.get("stop") and not p.get("stop_token_ids")):
        raise bad("min_tokens is supported only with ignore_eos and no stop strings or stop_token_ids "
                  "(then every request runs to max_tokens)", "min_tokens")
    n = 1 if req.n is None else req.n
    if req.best_of is not None and req.best_of != n:
        raise bad("best_of is not supported by ridge (only best_of = n)", "best_of")
    p["n"] = n
    return p, n


def llama_samplers(req: Sampling, p: dict) -> None:
    """The declared fields the body gives (llama-server's samplers among them), without OpenAI's
    defaults, into p."""
    p.update(dialect_params(OPENAI, req, defaults=False))


def _stream(req: Sampling) -> tuple[bool, bool]:
    stream = bool(req.stream)
    usage = bool(req.stream_options and req.stream_options.include_usage)
    if req.stream_options is not None and req.stream_options.include_usage is not None and not stream:
        raise bad("stream_options needs stream: true", "stream_options")
    return stream, usage


def _response_format(req: Sampling, body: dict, params: dict) -> None:
    """OpenAI's response_format (json_schema, json_object) and ridge's (regex, grammar) go to the
    daemon as they are (docs/protocol.md §3.2.1): it checks them and compiles them at admission,
    and its invalid_request comes back as a 400."""
    if req.response_format is not None and req.response_format.type != "text":
        params["response_format"] = body["response_format"]


def cache_salt(body: dict, authorization: str | None, sharing: str | None, keyed: bool = False) -> str | None:
    """The cache_salt sent to the daemon (docs/protocol.md §3.2.2): the gateway is one ipc peer for
    all its clients, so it keeps them apart itself (daemon/sharing.http_salt). keyed: the gateway
    requires its API key. The body's salt was checked to be a string by its request model."""
    return http_salt(body.get("cache_salt"), authorization, sharing, keyed)


# -- /v1/chat/completions ------------------------------------------------------------------------
ROLES = {"developer": "system"}  # OpenAI's newer name for the system message


def _content(content, where: str) -> str | list[dict]:
    """Text parts joined; with image_url parts, the daemon's array of text and image parts (images.py)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return joined([{"type": "text", "text": p.text} if p.type == "text" else from_url(p.image_url.url, f"{where}[{j}]")
                   for j, p in enumerate(content)])


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    """OpenAI's messages -> the daemon's (docs/protocol.md §3.2.3): text parts joined, the developer
    role as system, an assistant's calls and the tool results kept for the model's template."""
    out = []
    for i, m in enumerate(req.messages):
        if m.function_call:
            raise bad("function_call (OpenAI's older calls) is not supported by ridge; send tool_calls", "messages")
        msg = {"role": ROLES.get(m.role, m.role), "content": _content(m.content, f"messages[{i}].content")}
        if m.tool_calls:
            msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            msg["content"] = None if m.content is None else msg["content"]
        for key in ("tool_call_id", "name", "reasoning_content"):
            if (value := getattr(m, key)) is not None:
                msg[key] = value
        out.append(msg)
    return out


def turn_fields(req: ChatCompletionRequest, params: dict) -> None:
    """Tools, the template's variables and the thinking's budget, into the daemon's generate
    (§3.2.3). reasoning_effort goes to the template, where templates that know it read it; "none"
    turns thinking off (enable_thinking false) unless the request says otherwise."""
    if req.tools:
        params["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
    if req.tool_choice is not None:
        params["tool_choice"] = req.tool_choice if isinstance(req.tool_choice, str) else req.tool_choice.model_dump()
    if req.parallel_tool_calls is not None:
        params["parallel_tool_calls"] = req.parallel_tool_calls
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
        if req.reasoning_effort == "none":
            kwargs.setdefault("enable_thinking", False)
    if kwargs:
        params["chat_template_kwargs"] = kwargs
    if req.max_reasoning_tokens is not None:
        params["max_reasoning_tokens"] = req.max_reasoning_tokens


def chat_request(body: dict, max_tokens: int) -> Generation:
    req = parsed(ChatCompletionRequest, body)
    messages = chat_messages(req)
    given = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params, n = _sampling(req, max_tokens, given, max_tokens)
    _response_format(req, body, params)
    turn_fields(req, params)
    stream, usage = _stream(req)
    top = None
    if req.logprobs:
        top = req.top_logprobs or 0
        params["logprobs"] = max(1, top)  # the daemon's entries carry the chosen token's too
    elif req.top_logprobs:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    return Generation([{"messages": messages}], params, stream, usage, top, n)


# -- /v1/completions -------------------------------------------------------------------------------
def _prompts(prompt) -> list[dict]:
    """A string, an array of strings, an array of token ids, or an array of those arrays."""
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if isinstance(prompt[0], int):
        return [{"token_ids": prompt}]
    return [{"prompt": x} if isinstance(x, str) else {"token_ids": x} for x in prompt]


def completion_request(body: dict, limit: int | None = None) -> Generation:
    req = parsed(CompletionRequest, body)
    prompts = _prompts(req.prompt)
    if req.echo:
        raise bad("echo is not supported by ridge", "echo")
    if req.suffix:
        raise bad("suffix is not supported by ridge", "suffix")
    default = COMPLETION_DEFAULT_MAX_TOKENS if limit is None else min(COMPLETION_DEFAULT_MAX_TOKENS, limit)
    params, n = _sampling(req, default, req.max_tokens, limit)
    _response_format(req, body, params)  # not in OpenAI's completions; vLLM and llama-server take it there too
    stream, usage = _stream(req)
    if req.logprobs is not None:
        params["logprobs"] = max(1, req.logprobs)
    return Generation(prompts, params, stream, usage, req.logprobs, n)
