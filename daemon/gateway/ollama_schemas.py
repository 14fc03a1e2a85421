"""The bodies of Ollama's requests (its docs/api.md), as pydantic models of the
shapes its clients send, strict as schemas.py's are. Fields these models do
not name are ignored, as Ollama ignores them."""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import Field, create_model

from .dialects import OLLAMA
from .schemas import Answer, Body, Bool, FunctionTool, Int, Num, Stop, Str, nonempty

KeepAlive = Union[Str, Num, None]  # "5m", "1h30m", 300 (seconds); negative: held forever; 0: unloaded at once
Format = Union[Literal["", "json"], dict[str, Any], None]  # "json": any JSON object; a map: a JSON schema
Think = Union[Bool, Literal["low", "medium", "high"], None]


class RuntimeOptions(Body):
    """Ollama's `options` in a shape of their own (ollama_api.py reads them); the runtime's (num_thread,
    num_gpu, num_batch, use_mmap, ...) are ridge's own to choose, and ignored."""
    num_ctx: Optional[Int] = Field(None, description="at most the model's max_model_len")
    num_predict: Optional[Int] = Field(None, description="-1 or -2: until the context is full")


# Ollama's `options`: the request's declared fields in Ollama's words, with its defaults (dialects.py).
# Those that change the output are honoured or refused.
Options = create_model("Options", __base__=RuntimeOptions, __module__=__name__,
                       **OLLAMA.model_fields({"stop": Stop, "samplers": Optional[Union[list[Str], Str]]}))


class Generating(Body):
    model: Str
    options: Optional[Options] = None
    format: Format = None
    stream: Optional[Bool] = Field(None, description="default true")
    keep_alive: KeepAlive = Field(None, description="the daemon's keep_alive unless set")
    think: Think = None


class ToolFunction(Body):
    name: Str
    arguments: dict[str, Any] = Field(default_factory=dict)


class OllamaToolCall(Body):
    function: ToolFunction
    id: Optional[Str] = None


class Message(Body):
    role: Str
    content: Optional[Str] = ""
    thinking: Optional[Str] = None
    images: Optional[list[Str]] = Field(None, description="base64 images (a user message's), for a model that "
                                        "takes them")
    tool_calls: Optional[list[OllamaToolCall]] = None
    tool_name: Optional[Str] = None
    tool_call_id: Optional[Str] = None


class ChatRequest(Generating):
    messages: list[Message] = Field(default_factory=list, description="empty: only load the model")
    tools: Optional[list[FunctionTool]] = None


class GenerateRequest(Generating):
    prompt: Optional[Str] = Field(None, description="empty: only load the model")
    system: Optional[Str] = Field(None, description="the system message the template renders")
    raw: Optional[Bool] = None
    suffix: Optional[Str] = Field(None, description="only empty")
    images: Optional[list[Str]] = Field(None, description="base64 images, placed before the prompt in its user "
                                        "message, for a model that takes them")
    template: Optional[Str] = Field(None, description="only empty: the model's own template renders the prompt")
    context: Optional[list[Int]] = Field(None, description="refused: send the chat as messages to /api/chat")


class EmbedRequest(Body):
    model: Str
    input: Union[Str, nonempty(Str)]
    truncate: Optional[Bool] = Field(None, description="default true: an input past the context is cut to fit")
    dimensions: Optional[Int] = None
    keep_alive: KeepAlive = Field(None, description="the daemon's keep_alive unless set")
    options: Optional[Options] = None


class LegacyEmbedRequest(Body):
    """/api/embeddings: one prompt, one embedding."""
    model: Str
    prompt: Str
    keep_alive: KeepAlive = Field(None, description="the daemon's keep_alive unless set")


class ShowRequest(Body):
    model: Optional[Str] = None
    name: Optional[Str] = Field(None, description="the older name of `model`")


class PullRequest(Body):
    model: Optional[Str] = Field(None, description="hf.co/OWNER/REPO:TAG or OWNER/REPO[:TAG] (daemon/pull.py)")
    name: Optional[Str] = Field(None, description="the older name of `model`")
    insecure: Optional[Bool] = Field(None, description="accepted and ignored: the Hub is reached over HTTPS")
    stream: Optional[Bool] = None


# -- the answers' shapes, for /openapi.json (openapi.py) --------------------------------------------------
class OllamaError(Answer):
    error: str


class PullStatus(Answer):
    """One line of /api/pull's stream (its last: "success"), or with stream false the last alone."""
    status: str
    digest: Optional[str] = None
    total: Optional[int] = None
    completed: Optional[int] = None


class Turn(Answer):
    """One object of /api/chat or /api/generate (a whole answer, or one line of the NDJSON stream: the
    last has done true, done_reason and the counts)."""
    model: str
    created_at: str
    done: bool
    done_reason: Optional[str] = None


class ChatAnswer(Turn):
    message: dict[str, Any] = Field(description="role, content, and thinking and tool_calls when there are")


class GenerateAnswer(Turn):
    response: str


class EmbedAnswer(Answer):
    model: str
    embeddings: list[list[float]]


class LegacyEmbedAnswer(Answer):
    embedding: list[float]


class ModelListing(Answer):
    models: list[dict[str, Any]]


class ShowAnswer(Answer):
    modelfile: str
    parameters: str
    template: str
    details: dict[str, Any]
    model_info: dict[str, Any]
    capabilities: list[str]


class VersionAnswer(Answer):
    version: str
