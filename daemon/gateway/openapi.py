"""`GET /openapi.json`: the gateway's routes as an OpenAPI 3.1 document, every
route the app answers (on the `--ollama` listener, Ollama's /api routes too).
Its schemas are the pydantic models the routes check bodies with (schemas.py,
anthropic_schemas.py, responses_schemas.py, ollama_schemas.py, rerank_api.py)
and the shapes of their answers, so the document and the checks cannot
disagree. Built once per app."""
from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from . import anthropic_schemas as A
from . import ollama_schemas as O
from . import responses_schemas as RS
from . import schemas as S
from .rerank_api import ROUTES as RERANK_ROUTES, RerankAnswer, RerankRequest

REF = "#/components/schemas/{model}"
SSE_EVENT = {"type": "object", "description": "one server-sent event: its data is a JSON object (or OpenAI's "
             "closing [DONE]), named by `event` on /v1/messages and /v1/responses",
             "properties": {"event": {"type": "string"}, "data": {"type": "string"}}, "required": ["data"]}


@dataclass(frozen=True)
class Operation:
    path: str
    method: str
    summary: str
    answer: type[BaseModel] | None  # None: no model of it (media: text, or this document itself)
    body: type[BaseModel] | None = None
    streams: bool = False  # `stream: true` (Ollama's: unless `stream: false`) answers in stream_media
    stream_media: str = "text/event-stream"
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
    Operation("/openapi.json", "get", "This document", None, media="application/json"),
] + [Operation(path, "post", "Rerank documents for a query (Jina's and Cohere's shape)", RerankAnswer, RerankRequest)
     for path, _ in RERANK_ROUTES]

NDJSON = "application/x-ndjson"
OLLAMA_OPERATIONS = [  # the --ollama listener's, beside OPERATIONS; errors in Ollama's {"error"} shape
    Operation("/", "get", "Whether Ollama's API is served (\"Ollama is running\")", None, media="text/plain",
              error=O.OllamaError),
    Operation("/api/version", "get", "The Ollama API version spoken", O.VersionAnswer, error=O.OllamaError),
    Operation("/api/chat", "post", "Ollama's chat", O.ChatAnswer, O.ChatRequest, streams=True,
              stream_media=NDJSON, error=O.OllamaError),
    Operation("/api/generate", "post", "Ollama's completion of a prompt", O.GenerateAnswer, O.GenerateRequest,
              streams=True, stream_media=NDJSON, error=O.OllamaError),
    Operation("/api/embed", "post", "Ollama's embeddings", O.EmbedAnswer, O.EmbedRequest, error=O.OllamaError),
    Operation("/api/embeddings", "post", "Ollama's older embeddings: one prompt", O.LegacyEmbedAnswer,
              O.LegacyEmbedRequest, error=O.OllamaError),
    Operation("/api/tags", "get", "The models served", O.ModelListing, error=O.OllamaError),
    Operation("/api/ps", "get", "The models loaded", O.ModelListing, error=O.OllamaError),
    Operation("/api/show", "post", "One model's details", O.ShowAnswer, O.ShowRequest, error=O.OllamaError),
    Operation("/api/pull", "post", "Download a model from the Hugging Face Hub into models_dir (allow_pull)",
              O.PullStatus, O.PullRequest, streams=True, stream_media=NDJSON, error=O.OllamaError),
]


def _version() -> str:
    try:
        return version("ridge")
    except PackageNotFoundError:
        return "dev"


def _json(refs: dict, model: type[BaseModel], what: str) -> dict:
    return {"description": what, "content": {"application/json": {"schema": refs[(model, "serialization")]}}}


def _operation(op: Operation, refs: dict, keyed: bool) -> dict:
    plain = {"type": "object"} if op.media == "application/json" else {"type": "string"}
    media = {op.media: {"schema": refs[(op.answer, "serialization")] if op.answer else plain}}
    if op.streams:
        media[op.stream_media] = {"schema": SSE_EVENT if op.stream_media == "text/event-stream" else
                                  refs[(op.answer, "serialization")]}
    answers = {"200": {"description": "the answer" + (f" ({op.stream_media} when streamed)" if op.streams else ""),
                       "content": media},
               "4XX": _json(refs, op.error, "a refusal"), "5XX": _json(refs, op.error, "a failure")}
    if op.unavailable:
        answers["503"] = _json(refs, op.unavailable, "the daemon does not serve")
    name = op.path.strip("/").replace("/", "_").replace(".", "_") or "root"
    out: dict = {"summary": op.summary, "operationId": f"{op.method}_{name}",
                 "responses": answers}
    if op.body is not None:
        out["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": refs[(op.body, "validation")]}}}
    if op.path_param:
        out["parameters"] = [{"name": op.path_param, "in": "path", "required": True, "schema": {"type": "string"}}]
    if keyed and op.path not in ("/health", "/openapi.json"):
        out["security"] = [{"bearer": []}] + ([{"x_api_key": []}] if op.error is A.AnthropicError else [])
    return out


def operations(ollama: bool) -> list[Operation]:
    return OPERATIONS + (OLLAMA_OPERATIONS if ollama else [])


def document(keyed: bool, ollama: bool) -> dict:
    """keyed: the gateway asks for an API key; ollama: the --ollama listener's document."""
    ops = operations(ollama)
    models = {(op.body, "validation") for op in ops if op.body}
    models |= {(m, "serialization") for op in ops for m in (op.answer, op.error, op.unavailable) if m}
    refs, schemas = models_json_schema(sorted(models, key=lambda m: (m[0].__name__, m[1])), ref_template=REF)
    paths: dict = {}
    for op in ops:
        paths.setdefault(op.path, {})[op.method] = _operation(op, refs, keyed)
    components: dict = {"schemas": schemas.get("$defs", {})}
    if keyed:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"},
                                         "x_api_key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
    return {"openapi": "3.1.0", "info": {"title": "ridge", "version": _version(),
                                         "description": "ridge's HTTP gateway: OpenAI's and Anthropic's APIs"
                                         + (", and Ollama's" if ollama else "")},
            "paths": paths, "components": components}
