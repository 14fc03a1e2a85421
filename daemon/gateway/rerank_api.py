"""POST /v1/rerank (also /rerank and /v2/rerank, as vLLM serves it) in Jina's and
Cohere's shape: a query, documents (strings, or objects with a `text`), `top_n`
and `return_documents`; one daemon `rerank` for them all (docs/protocol.md
§3.11), its results the best first, each with its `index` among the documents
and its `relevance_score` (the reranker's P(yes), engine/rerank.py)."""
from __future__ import annotations

import uuid
from typing import Any, Optional, Union

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from . import turn
from .generation import until_disconnect
from .openai_api import bad
from .schemas import Answer, Body, Bool, Int, Str, nonempty


class TextDocument(Body):
    text: Str


class RerankRequest(Body):
    model: Optional[Str] = None
    query: Str
    documents: nonempty(Union[Str, TextDocument])
    top_n: Optional[Int] = Field(None, description="the best this many (default: all)")
    return_documents: Optional[Bool] = Field(None, description="default true (Jina's); false leaves them out")
    instruction: Optional[Str] = Field(None, description="ridge: the task the reranker judges for (Qwen3-Reranker's "
                                                         "Instruct; default: web search)")


class RerankResult(Answer):
    index: int
    relevance_score: float
    document: Optional[dict[str, Any]] = Field(None, description="{text}; left out with return_documents false")


class RerankAnswer(Answer):
    id: str
    model: str
    results: list[RerankResult] = Field(description="the best first")
    usage: dict[str, Any]
    meta: dict[str, Any] = Field(description="Cohere's billed_units and tokens")


def _text(d) -> str:
    return d if isinstance(d, str) else d.text


async def rerank(request: Request) -> Response:
    link, _, _, req = await turn.checked(request, RerankRequest)
    texts = [_text(d) for d in req.documents]
    if not req.query:
        raise bad("query: an empty string", "query")
    fields: dict = {"query": req.query, "documents": texts}
    for key in ("top_n", "instruction"):
        if (v := getattr(req, key)) is not None:
            fields[key] = v
    if req.model:
        fields["model"] = req.model
    reply = await until_disconnect(request, link.call("rerank", **fields))
    turn.ended(reply, "rerank")
    results = []
    for r in reply["results"]:
        item = {"index": r["index"], "relevance_score": r["relevance_score"]}
        if req.return_documents is not False:
            item["document"] = {"text": texts[r["index"]]}
        results.append(item)
    usage = reply["usage"]
    return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": req.model or link.model["name"],
                         "results": results, "usage": usage,
                         "meta": {"billed_units": {"search_units": 1}, "tokens": {"input_tokens": usage["prompt_tokens"]}}})


ROUTES = [("/v1/rerank", rerank), ("/rerank", rerank), ("/v2/rerank", rerank)]
