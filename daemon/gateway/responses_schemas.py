"""OpenAI's Responses API (`POST /v1/responses`) as pydantic models of the
shapes OpenAI documents, and its answers' shapes, for /openapi.json. The
rules are schemas.py's: shapes here, values at the daemon, fields not named
here ignored."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, Discriminator, Field, Tag, create_model

from ridge.request import GENERATE

from .dialects import RESPONSES
from .schemas import SHAPES, Answer, Body, Bool, Function, FunctionName, Int, Str, text_or


class InputText(Body):
    type: Literal["input_text"]
    text: Str


class OutputText(Body):
    type: Literal["output_text"]
    text: Str


class Refusal(Body):
    type: Literal["refusal"]
    refusal: Str


class InputImage(Body):
    type: Literal["input_image"]
    image_url: Optional[Str] = Field(None, description="a data: URL; http(s) only when the gateway's "
                                     "allow_image_urls is on")
    file_id: Optional[Str] = Field(None, description="refused: ridge keeps no files")
    detail: Optional[Literal["auto", "low", "high"]] = Field(None, description="ignored: the model's own "
                                                             "preprocessing sets the resolution")


Part = Annotated[Union[InputText, InputImage, OutputText, Refusal], Field(discriminator="type")]


class MessageItem(Body):
    """A message: EasyInputMessage (no `type` needed), or an earlier output message sent back."""
    type: Optional[Literal["message"]] = None
    role: Literal["user", "assistant", "system", "developer"]
    content: text_or(Part)
    id: Optional[Str] = None


class FunctionCallItem(Body):
    type: Literal["function_call"]
    call_id: Str
    name: Str
    arguments: Str = Field(description="the arguments, as a JSON text")
    id: Optional[Str] = None


class FunctionCallOutputItem(Body):
    type: Literal["function_call_output"]
    call_id: Str
    output: text_or(Part)


class SummaryText(Body):
    type: Literal["summary_text"]
    text: Str


class ReasoningText(Body):
    type: Literal["reasoning_text"]
    text: Str


class ReasoningItem(Body):
    type: Literal["reasoning"]
    id: Optional[Str] = None
    summary: list[SummaryText] = []
    content: Optional[list[ReasoningText]] = None
    encrypted_content: Optional[Str] = None


def _kind(v) -> str | None:
    if isinstance(v, dict):
        return v.get("type") or "message"
    return getattr(v, "type", None) or "message"


InputItem = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                            Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                            Annotated[ReasoningItem, Tag("reasoning")]],
                      Discriminator(_kind, custom_error_type="invalid_item",
                                    custom_error_message="an input item's type must be message, function_call, "
                                    "function_call_output or reasoning")]


class ResponsesFunctionTool(Function):
    """Chat's function, flat: its type beside its name."""
    type: Literal["function"]


class ResponsesNamedTool(FunctionName):
    type: Literal["function"]


ToolChoice = Union[Literal["none", "auto", "required"], ResponsesNamedTool]


class TextFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[Str] = None
    description: Optional[Str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema", description="with type json_schema")
    strict: Optional[Bool] = None


class TextOptions(Body):
    format: Optional[TextFormat] = None


class ReasoningOptions(Body):
    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh"]] = None
    summary: Optional[Str] = None


# OpenAI's bounds on a response's metadata, which the store keeps with it for responses_ttl.
METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


def _metadata(m: dict[str, str]) -> dict[str, str]:
    if len(m) > METADATA_KEYS:
        raise ValueError(f"at most {METADATA_KEYS} keys")
    for k, v in m.items():
        if len(k) > METADATA_KEY_CHARS:
            raise ValueError(f"a key of at most {METADATA_KEY_CHARS} characters")
        if len(v) > METADATA_VALUE_CHARS:
            raise ValueError(f"a value of at most {METADATA_VALUE_CHARS} characters")
    return m


Metadata = Annotated[dict[str, Str], AfterValidator(_metadata),
                     Field(description=f"at most {METADATA_KEYS} keys of at most {METADATA_KEY_CHARS} characters, "
                           f"values of at most {METADATA_VALUE_CHARS}")]


class ResponsesFields(Body):
    model: Optional[Str] = None
    input: text_or(InputItem)
    instructions: Optional[Str] = None
    previous_response_id: Optional[Str] = Field(None, description="continue that response's conversation (kept for "
                                                "responses_ttl seconds)")
    max_output_tokens: Optional[Int] = None
    stream: Optional[Bool] = None
    store: Optional[Bool] = Field(None, description="default true: keep it for previous_response_id")
    tools: Optional[list[ResponsesFunctionTool]] = None
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Optional[Bool] = None
    text: Optional[TextOptions] = None
    reasoning: Optional[ReasoningOptions] = None
    truncation: Optional[Literal["disabled"]] = Field(None, description="only disabled")
    metadata: Optional[Metadata] = None
    background: Optional[Literal[False]] = Field(None, description="only false")
    cache_salt: Optional[Str] = Field(None, description="ridge: " + GENERATE["cache_salt"].doc)


# With the request's declared fields under chat's names (temperature, top_p, and ridge's own as on
# /v1/chat/completions: dialects.RESPONSES).
ResponsesRequest = create_model("ResponsesRequest", __base__=ResponsesFields, __module__=__name__,
                                **RESPONSES.model_fields(SHAPES))


# -- answers -------------------------------------------------------------------------------------------------
class OutputTextAnswer(Answer):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]


class OutputMessage(Answer):
    type: Literal["message"]
    id: str
    status: Literal["completed", "incomplete", "in_progress"]
    role: Literal["assistant"]
    content: list[OutputTextAnswer]


class FunctionCallAnswer(Answer):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["completed", "incomplete", "in_progress"]


class ReasoningAnswer(Answer):
    type: Literal["reasoning"]
    id: str
    summary: list[Any]
    content: list[Any]


OutputItem = Annotated[Union[OutputMessage, FunctionCallAnswer, ReasoningAnswer], Field(discriminator="type")]


class ResponsesUsage(Answer):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(Answer):
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    model: str
    output: list[OutputItem]
    usage: Optional[ResponsesUsage]
    error: Optional[dict[str, Any]]
    incomplete_details: Optional[dict[str, Any]]
    instructions: Optional[str]
    previous_response_id: Optional[str]
    parallel_tool_calls: bool
    tool_choice: Any
    tools: list[Any]


class DeletedResponse(Answer):
    id: str
    object: Literal["response"]
    deleted: bool
