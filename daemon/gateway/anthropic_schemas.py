"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`)
as pydantic models of the shapes Anthropic documents, and its answers' shapes,
for /openapi.json. The rules are schemas.py's: shapes here, values at the
daemon, fields not named here ignored."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field, create_model

from ridge.request import GENERATE

from .dialects import ANTHROPIC
from .schemas import SHAPES, Answer, Body, Bool, Int, Str, nonempty, text_or


class TextBlock(Body):
    type: Literal["text"]
    text: Str


class ToolUseBlock(Body):
    type: Literal["tool_use"]
    id: Str
    name: Str
    input: dict[str, Any]


class ToolResultBlock(Body):
    type: Literal["tool_result"]
    tool_use_id: Str
    content: Optional[text_or(TextBlock)] = None
    is_error: Optional[Bool] = None


class ThinkingBlock(Body):
    type: Literal["thinking"]
    thinking: Str
    signature: Optional[Str] = None


class RedactedThinkingBlock(Body):
    type: Literal["redacted_thinking"]
    data: Str


class Base64Source(Body):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: Str


class UrlSource(Body):
    type: Literal["url"]
    url: Str = Field(description="http(s): fetched only when the gateway's allow_image_urls is on")


class ImageBlock(Body):
    type: Literal["image"]
    source: Annotated[Union[Base64Source, UrlSource], Field(discriminator="type")]


Block = Annotated[Union[TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock],
                  Field(discriminator="type")]


class AnthropicMessage(Body):
    role: Literal["user", "assistant", "system"] = Field(
        description="system: Claude Code's system messages among the turns (text only), rendered where they stand")
    content: text_or(Block)


class AnthropicTool(Body):
    name: Str
    description: Optional[Str] = None
    input_schema: dict[str, Any] = Field(description="a JSON schema of the tool's input (an object)")
    type: Optional[Literal["custom"]] = None


class AnthropicToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[Str] = Field(None, description="the tool, with type tool")
    disable_parallel_tool_use: Optional[Bool] = None


class Thinking(Body):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Optional[Int] = Field(None, description="with type enabled: the most tokens the thinking takes")


class JsonOutputFormat(Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema", description="the JSON schema the answer's text follows")


class OutputConfig(Body):
    effort: Optional[Literal["low", "medium", "high", "xhigh", "max"]] = None
    format: Optional[JsonOutputFormat] = None


class Prompted(Body):
    """What a request to the model and a count of its tokens share."""
    model: Str
    messages: nonempty(AnthropicMessage)
    system: Optional[text_or(TextBlock)] = None
    tools: Optional[list[AnthropicTool]] = None
    tool_choice: Optional[AnthropicToolChoice] = None
    thinking: Optional[Thinking] = None
    output_config: Optional[OutputConfig] = None


class MessagesFields(Prompted):
    max_tokens: Int
    stream: Optional[Bool] = None
    cache_salt: Optional[Str] = Field(None, description="ridge: " + GENERATE["cache_salt"].doc)


# With the request's declared fields in Anthropic's words (stop_sequences, temperature, top_p, top_k,
# and ridge's own under chat's names: dialects.ANTHROPIC).
MessagesRequest = create_model("MessagesRequest", __base__=MessagesFields, __module__=__name__,
                               **ANTHROPIC.model_fields({k: v for k, v in SHAPES.items() if k != "stop"}))


class CountTokensRequest(Prompted):
    pass


# -- answers -------------------------------------------------------------------------------------------------
class AnthropicErrorDetail(Answer):
    type: str
    message: str


class AnthropicError(Answer):
    """Anthropic's error shape, on /v1/messages."""
    type: Literal["error"]
    error: AnthropicErrorDetail


class AnthropicUsage(Answer):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: Optional[int] = None
    cache_creation_input_tokens: Optional[int] = None


class MessageAnswer(Answer):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[Annotated[Union[TextBlock, ThinkingBlock, ToolUseBlock], Field(discriminator="type")]]
    stop_reason: Optional[Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]]
    stop_sequence: Optional[str]
    usage: AnthropicUsage


class TokenCount(Answer):
    input_tokens: int
