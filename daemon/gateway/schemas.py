"""The bodies of OpenAI's chat and completions requests, as pydantic models of
the shapes OpenAI documents, with ridge's extensions under vLLM's and
llama-server's names (the request's declared fields in OpenAI's words:
dialects.py), and the shapes of the answers, for
/openapi.json (openapi.py). anthropic_schemas.py and responses_schemas.py do
the same for /v1/messages and /v1/responses.

The models check shapes: a JSON type, a required field, which of a union's
forms. Values (ranges, limits, token ids) are the daemon's to check, once,
and its refusal is the HTTP error (openai_api.py). Fields these models do not
name are ignored, as OpenAI's clients send fields a server may not know
(`user`, `metadata`, `store`). Types are strict: "1" is not an integer and 1
is not a boolean, as JSON means them."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictFloat, StrictInt, StrictStr, Tag,
                      WrapValidator, create_model)
from pydantic_core import PydanticCustomError, ValidationError

from ridge.request import GENERATE

from .dialects import OPENAI

Int = StrictInt  # within msgpack's range: generation.read_json refuses others
Num = StrictFloat  # strict floats take JSON integers too
Str = StrictStr
Bool = StrictBool
MAX_PROMPTS = 64  # prompts in one /v1/completions request


def one_of(what: str):
    """A union's refusal as one message: pydantic would list each form's own."""
    def check(value, handler):
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("invalid_value", what) from None
    return WrapValidator(check)


FORMS = ("string", "array")  # text_or's tags, which pydantic puts in an error's location


def _form(value) -> str:
    return "string" if isinstance(value, str) else "array"


def text_or(kind):
    """A string, or an array of `kind`: the value's JSON type says which, so that a refusal is the
    fault in that form, not one per form."""
    return Annotated[Union[Annotated[Str, Tag("string")], Annotated[list[kind], Tag("array")]], Discriminator(_form)]


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Answer(BaseModel):
    """An answer's shape, for the schema only: the gateway builds answers as plain data."""
    model_config = ConfigDict(extra="allow")


def nonempty(kind):
    return Annotated[list[kind], Field(min_length=1)]


# -- what both OpenAI endpoints take ------------------------------------------------------------------
class JsonSchemaFormat(Body):
    name: Optional[Str] = None
    description: Optional[Str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema", description="a JSON schema")
    strict: Optional[Bool] = None


class ResponseFormat(Body):
    """OpenAI's shapes and ridge's regex and grammar (docs/protocol.md §3.2.1)."""
    type: Literal["text", "json_object", "json_schema", "regex", "grammar"]
    json_schema: Optional[JsonSchemaFormat] = None
    regex: Optional[Str] = Field(None, description="ridge: the output matches this regex whole")
    grammar: Optional[Str] = Field(None, description="ridge: the output is in this Lark (or GBNF) grammar")


class StreamOptions(Body):
    include_usage: Optional[Bool] = None


Stop = Annotated[Union[Str, list[Str], None], one_of("must be a string or an array of strings")]
Bias = Union[Num, Literal[False]]  # llama-server's false: the token is banned
LogitBias = Annotated[Union[dict[str, Bias], list[tuple[Union[Int, Str], Bias]], None],
                      one_of("must be a map of token id to bias, or an array of [token id or string, bias] pairs")]


# Where an API's JSON shape of a declared field is wider than its type (ridge/request.py): a stop
# string or strings, logit_bias as OpenAI's map or llama-server's pairs, samplers as names or letters.
SHAPES = {"stop": Stop, "logit_bias": LogitBias, "samplers": Optional[Union[list[Str], Str]]}


# The declared fields in OpenAI's words (dialects.py).
Declared = create_model("OpenAIDeclared", __base__=Body, __module__=__name__, **OPENAI.model_fields(SHAPES))


class Sampling(Declared):
    """The fields chat and completions share: the declared ones, and the OpenAI fields in a shape of
    their own (openai_api.py translates them)."""
    model: Optional[Str] = None
    max_tokens: Optional[Int] = None
    n: Optional[Int] = None
    best_of: Optional[Int] = Field(None, description="only best_of = n")
    response_format: Optional[ResponseFormat] = None
    stream: Optional[Bool] = None
    stream_options: Optional[StreamOptions] = None
    min_tokens: Optional[Int] = Field(None, description="ridge: only with ignore_eos and no stop")
    cache_salt: Optional[Str] = Field(None, description="ridge: " + GENERATE["cache_salt"].doc)


# -- /v1/chat/completions -------------------------------------------------------------------------------
class TextPart(Body):
    type: Literal["text"]
    text: Str


class FunctionCall(Body):
    name: Str
    arguments: Str = Field(description="the arguments, as a JSON text")


class ToolCall(Body):
    id: Str
    type: Literal["function"] = "function"
    function: FunctionCall


class ImageUrl(Body):
    url: Str = Field(description="a data: URL (data:image/png;base64,...); http(s) only when the gateway's "
                     "allow_image_urls is on")
    detail: Optional[Literal["auto", "low", "high"]] = Field(None, description="ignored: the model's own "
                                                             "preprocessing sets the resolution")


class ImageUrlPart(Body):
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[Union[TextPart, ImageUrlPart], Field(discriminator="type")]


class ChatMessage(Body):
    role: Str
    content: Optional[text_or(ContentPart)] = Field(None, description="text, or text and image_url parts (images "
                                                    "in user messages, for a model that takes them)")
    name: Optional[Str] = None
    tool_calls: Optional[list[ToolCall]] = Field(None, description="an assistant's calls")
    tool_call_id: Optional[Str] = Field(None, description="a tool message: the call it answers")
    reasoning_content: Optional[Str] = Field(None, description="an assistant's thinking (vLLM's name)")
    function_call: Optional[dict[str, Any]] = Field(None, description="OpenAI's older calls: refused")


class Function(Body):
    name: Str
    description: Optional[Str] = None
    parameters: Optional[dict[str, Any]] = Field(None, description="a JSON schema of the arguments (an object)")
    strict: Optional[Bool] = None


class FunctionTool(Body):
    type: Literal["function"]
    function: Function


class FunctionName(Body):
    name: Str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]
Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class ChatCompletionRequest(Sampling):
    messages: nonempty(ChatMessage)
    max_completion_tokens: Optional[Int] = None
    logprobs: Optional[Bool] = None
    top_logprobs: Optional[Int] = None
    tools: Optional[list[FunctionTool]] = None
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Optional[Bool] = None
    reasoning_effort: Optional[Effort] = None
    # ridge's own, under vLLM's names
    chat_template_kwargs: Optional[dict[str, Any]] = Field(None, description="ridge: extra variables for the chat "
                                                           "template ({\"enable_thinking\": false})")
    max_reasoning_tokens: Optional[Int] = Field(None, description="ridge: the thinking's budget, in tokens")


# -- /v1/completions -------------------------------------------------------------------------------------
Prompt = Annotated[Union[Str, nonempty(Int), Annotated[list[Str], Field(min_length=1, max_length=MAX_PROMPTS)],
                         Annotated[list[nonempty(Int)], Field(min_length=1, max_length=MAX_PROMPTS)]],
                   one_of(f"must be a string, an array of token ids, or an array of up to {MAX_PROMPTS} of those")]


class CompletionRequest(Sampling):
    prompt: Prompt
    echo: Optional[Bool] = Field(None, description="only false")
    suffix: Optional[Str] = Field(None, description="only empty")
    logprobs: Optional[Int] = None


# -- answers -------------------------------------------------------------------------------------------------
class ErrorDetail(Answer):
    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorBody(Answer):
    """OpenAI's error shape, on every route but /v1/messages."""
    error: ErrorDetail


class Usage(Answer):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatChoiceMessage(Answer):
    role: Literal["assistant"]
    content: Optional[str]
    tool_calls: Optional[list[ToolCall]] = None
    reasoning_content: Optional[str] = None


class ChatChoice(Answer):
    index: int
    message: ChatChoiceMessage
    logprobs: Optional[dict[str, Any]]
    finish_reason: Optional[str]


class ChatCompletion(Answer):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(Answer):
    index: int
    text: str
    logprobs: Optional[dict[str, Any]]
    finish_reason: Optional[str]


class Completion(Answer):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ModelCard(Answer):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: Optional[int]  # None: a model not loaded yet, whose context is known once it is


class ModelList(Answer):
    object: Literal["list"]
    data: list[ModelCard]


class Health(Answer):
    status: str
    model: Optional[str] = None
    running: Optional[int] = None
    waiting: Optional[int] = None
    error: Optional[str] = None


# -- /v1/embeddings ------------------------------------------------------------------------------------
def _embedding_input(value) -> str:
    if isinstance(value, str):
        return "string"
    if isinstance(value, list) and value and all(isinstance(x, list) for x in value):
        return "token_lists"
    if isinstance(value, list) and value and all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        return "tokens"
    return "strings"


EmbeddingInput = Annotated[Union[Annotated[Str, Tag("string")], Annotated[nonempty(Str), Tag("strings")],
                                 Annotated[nonempty(Int), Tag("tokens")],
                                 Annotated[nonempty(nonempty(Int)), Tag("token_lists")]],
                           Discriminator(_embedding_input)]


class EmbeddingRequest(Body):
    """OpenAI's embeddings request: a string, strings, token ids or lists of them."""
    input: EmbeddingInput
    model: Optional[Str] = None
    dimensions: Optional[Int] = Field(None, description="keep the first this many components, renormalised")
    encoding_format: Optional[Literal["float", "base64"]] = None
    user: Optional[Str] = None


class Embedding(Answer):
    object: Literal["embedding"]
    index: int
    embedding: Union[list[float], str] = Field(description="floats, or base64 of little-endian float32")


class EmbeddingUsage(Answer):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(Answer):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
