"""The bodies of OpenAI's chat and completions requests, as pydantic models of
the shapes OpenAI documents, with ridge's extensions under vLLM's names
(`top_k`, `min_p`, `ignore_eos`, ...), and the shapes of the answers, for
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
                      WrapValidator)
from pydantic_core import PydanticCustomError, ValidationError

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


class Sampling(Body):
    """The fields chat and completions share."""
    model: Optional[Str] = None
    max_tokens: Optional[Int] = None
    temperature: Optional[Num] = Field(None, description="default 1.0, as OpenAI's")
    top_p: Optional[Num] = None
    n: Optional[Int] = None
    best_of: Optional[Int] = Field(None, description="only best_of = n")
    seed: Optional[Int] = None
    stop: Stop = None
    presence_penalty: Optional[Num] = Field(None, description="[-2, 2], over the generated tokens")
    frequency_penalty: Optional[Num] = Field(None, description="[-2, 2], over the generated tokens")
    logit_bias: LogitBias = Field(None, description="token id -> bias; or llama-server's [[token id or string, "
                                                    "bias or false], ...]")
    response_format: Optional[ResponseFormat] = None
    stream: Optional[Bool] = None
    stream_options: Optional[StreamOptions] = None
    # ridge's own, under vLLM's names
    top_k: Optional[Int] = Field(None, description="ridge: 0 or -1 = off")
    min_p: Optional[Num] = None
    repetition_penalty: Optional[Num] = Field(None, description="vLLM's: over the whole context unless repeat_last_n")
    # llama-server's samplers, under its names (docs/protocol.md §3.2)
    repeat_penalty: Optional[Num] = Field(None, description="llama-server's: over the last repeat_last_n (64) tokens")
    repeat_last_n: Optional[Int] = Field(None, description="-1: the whole context, 0: off")
    typical_p: Optional[Num] = None
    top_n_sigma: Optional[Num] = None
    mirostat: Optional[Int] = Field(None, description="0, 1 or 2")
    mirostat_tau: Optional[Num] = None
    mirostat_eta: Optional[Num] = None
    dry_multiplier: Optional[Num] = None
    dry_base: Optional[Num] = None
    dry_allowed_length: Optional[Int] = None
    dry_penalty_last_n: Optional[Int] = None
    dry_sequence_breakers: Optional[list[Str]] = None
    xtc_probability: Optional[Num] = None
    xtc_threshold: Optional[Num] = None
    samplers: Optional[list[Str]] = Field(None, description="llama-server's sampler names, in order")
    stop_token_ids: Optional[list[Int]] = None
    ignore_eos: Optional[Bool] = None
    min_tokens: Optional[Int] = Field(None, description="ridge: only with ignore_eos and no stop")
    cache_salt: Optional[Str] = Field(None, description="ridge: shares cached prefixes only with the same salt")
    deterministic: Optional[Bool] = Field(None, description="ridge: the same tokens whatever the batch, chunking and "
                                                             "speculation (default: the daemon's --deterministic)")


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


class ChatMessage(Body):
    role: Str
    content: Optional[text_or(TextPart)] = None
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
