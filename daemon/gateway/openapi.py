"""`GET /openapi.json`: the gateway's routes as an OpenAPI 3.1 document. Its
schemas are the pydantic models the routes check bodies with (schemas.py,
anthropic_schemas.py, responses_schemas.py) and the shapes of their answers,
so the document and the checks cannot disagree. Built once per app."""
from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from . import anthropic_schemas as A
from . import responses_schemas as RS
from . import schemas as S

REF = "#/components/schemas/{model}"
SSE_EVENT = {"type": "object", "description": "one server-sent event: its data is a JSON object (or OpenAI's "
             "closing [DONE]), named by `event` on /v1/messages and /v1/responses",
             "properties": {"event": {"type": "string"}, "data": {"type": "string"}}, "required": ["data"]}


@dataclass(frozen=True)
class Operation:
    path: str
    method: str
    summary: str
    answer: type[BaseModel] | None  # None: the answer is not JSON (media)
    body: type[BaseModel] | None = None
    streams: bool = False  # `stream: true` answers with server-sent events
    error: type[BaseModel] = S.ErrorBody
    media: str = "application/json"
    path_param: str | None = None
    unavailable: type[BaseModel] | None = None  # the 503's shape, where it is not the error's


OPERATIONS = [
    Operation("/health", "get", "Whether the daemon serves (503 while it does not)", S.Health,
              unavailable=S.Health),
    Operation("/v1/models", "get", "The model served", S.ModelList),
    Operation("/v1/models/{model}", "get", "One model, by name", S.ModelCard, path_param="model"),
    Operation("/v1/chat/completions", "post", "OpenAI's chat completions", S.ChatCompletion,
              S.ChatCompletionRequest, streams=True),
    Operation("/v1/completions", "post", "OpenAI's completions", S.Completion, S.CompletionRequest, streams=True),
    Operation("/v1/embeddings", "post", "OpenAI's embeddings (an embedding model's daemon)", S.EmbeddingList,
              S.EmbeddingRequest),
    Operation("/v1/messages", "post", "Anthropic's messages", A.MessageAnswer, A.MessagesRequest, streams=True,
              error=A.AnthropicError),
    Operation("/v1/messages/count_tokens", "post", "The tokens of a messages request's prompt", A.TokenCount,
              A.CountTokensRequest, error=A.AnthropicError),
    Operation("/v1/responses", "post", "OpenAI's responses", RS.ResponseObject, RS.ResponsesRequest, streams=True),
    Operation("/v1/responses/{response_id}", "get", "A stored response", RS.ResponseObject,
              path_param="response_id"),
    Operation("/v1/responses/{response_id}", "delete", "Forget a stored response", RS.DeletedResponse,
              path_param="response_id"),
    Operation("/metrics", "get", "Prometheus metrics", None, media="text/plain"),
]


def _version() -> str:
    try:
        return version("ridge")
    except PackageNotFoundError:
        return "dev"


def _json(refs: dict, model: type[BaseModel], what: str) -> dict:
    return {"description": what, "content": {"application/json": {"schema": refs[(model, "serialization")]}}}


def _operation(op: Operation, refs: dict, keyed: bool) -> dict:
    media = {op.media: {"schema": refs[(op.answer, "serialization")] if op.answer else {"type": "string"}}}
    if op.streams:
        media["text/event-stream"] = {"schema": SSE_EVENT}
    answers = {"200": {"description": "the answer" + (" (server-sent events with stream: true)" if op.streams else ""),
                       "content": media},
               "4XX": _json(refs, op.error, "a refusal"), "5XX": _json(refs, op.error, "a failure")}
    if op.unavailable:
        answers["503"] = _json(refs, op.unavailable, "the daemon does not serve")
    out: dict = {"summary": op.summary, "operationId": f"{op.method}_{op.path.strip('/').replace('/', '_')}",
                 "responses": answers}
    if op.body is not None:
        out["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": refs[(op.body, "validation")]}}}
    if op.path_param:
        out["parameters"] = [{"name": op.path_param, "in": "path", "required": True, "schema": {"type": "string"}}]
    if keyed and op.path != "/health":
        out["security"] = [{"bearer": []}] + ([{"x_api_key": []}] if op.error is A.AnthropicError else [])
    return out


def document(keyed: bool) -> dict:
    """keyed: the gateway asks for an API key."""
    models = {(op.body, "validation") for op in OPERATIONS if op.body}
    models |= {(m, "serialization") for op in OPERATIONS for m in (op.answer, op.error, op.unavailable) if m}
    refs, schemas = models_json_schema(sorted(models, key=lambda m: (m[0].__name__, m[1])), ref_template=REF)
    paths: dict = {}
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method] = _operation(op, refs, keyed)
    components: dict = {"schemas": schemas.get("$defs", {})}
    if keyed:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"},
                                         "x_api_key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
    return {"openapi": "3.1.0", "info": {"title": "ridge", "version": _version(),
                                         "description": "ridge's HTTP gateway: OpenAI's and Anthropic's APIs"},
            "paths": paths, "components": components}
