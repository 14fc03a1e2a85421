"""POST /v1/embeddings in OpenAI's shape: the body checked (schemas.EmbeddingRequest),
one daemon `embed` for all of its inputs (docs/protocol.md §3.6), the vectors as
floats or base64 of little-endian float32, as OpenAI's clients decode them."""
from __future__ import annotations

import base64

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from . import turn
from .generation import DEFAULT_BODY_LIMIT, model_fields, read_json, served, until_disconnect
from .openai_api import bad, parsed
from .schemas import EmbeddingRequest


def _inputs(value) -> list:
    """A string, strings, token ids, or lists of them -> the daemon's array of inputs."""
    if isinstance(value, str):
        return [value]
    if value and isinstance(value[0], int):
        return [value]
    return list(value)


def _encoded(vec: list[float], fmt: str | None):
    return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode() if fmt == "base64" else vec


async def embeddings(request: Request) -> Response:
    link = request.app.state.link
    await link.connect()
    body = await read_json(request, 2 * link.limits.get("max_frame_bytes", DEFAULT_BODY_LIMIT // 2))
    req = parsed(EmbeddingRequest, body)
    inputs = _inputs(req.input)
    if any(x == "" for x in inputs):
        raise bad("input: an input is an empty string", "input")
    fields = {"input": inputs, **model_fields(body)}
    if req.dimensions is not None:
        fields["dimensions"] = req.dimensions
    reply = await until_disconnect(request, link.call("embed", **fields))
    turn.ended(reply, "embedding")
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, req.encoding_format)}
            for i, v in enumerate(reply["data"])]
    return JSONResponse({"object": "list", "data": data, "model": served(link, fields), "usage": reply["usage"]})
