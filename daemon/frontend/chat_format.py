"""What a model's chat template says about tool calls and reasoning
(docs/protocol.md §3.2.3), read once per daemon: the format its calls are
written in, chosen from the template with no flag; whether the model
reasons; each marker as the tokenizer holds it; and, for a template that
renders no tools, ridge's own prompt for them."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

# gpt-oss's harmony (daemon/frontend/harmony.py): its markers, every one a special token
HARMONY_TOKENS = {"start": "<|start|>", "channel": "<|channel|>", "message": "<|message|>", "end": "<|end|>",
                  "call": "<|call|>", "return": "<|return|>", "constrain": "<|constrain|>"}

HERMES, LLAMA3_JSON, MISTRAL, HARMONY = "hermes", "llama3_json", "mistral", "harmony"
QWEN3_XML, GEMMA4 = "qwen3_xml", "gemma4"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Gemma 4's thinking is a channel named "thought": <|channel>thought\n...<channel|>, the markers special tokens.
GEMMA_THINK_OPEN, GEMMA_THINK_CLOSE = "<|channel>thought\n", "<channel|>"
# The markers each format writes, by role.
MARKER_TEXT = {"call_open": "<tool_call>", "call_close": "</tool_call>", "python_tag": "<|python_tag|>",
               "tool_calls": "[TOOL_CALLS]", "think_open": THINK_OPEN, "think_close": THINK_CLOSE,
               "g_call_open": "<|tool_call>", "g_call_close": "<tool_call|>", "g_quote": '<|"|>',
               **{"h_" + k: t for k, t in HARMONY_TOKENS.items()}}
FORMAT_MARKERS = {HERMES: ("call_open", "call_close"), LLAMA3_JSON: ("python_tag",), MISTRAL: ("tool_calls",),
                  HARMONY: tuple("h_" + k for k in HARMONY_TOKENS), QWEN3_XML: ("call_open", "call_close"),
                  GEMMA4: ("g_call_open", "g_call_close", "g_quote")}
# The thinking's markers, by format: <think>/</think> unless the format says otherwise.
THINK_MARKERS = {GEMMA4: (GEMMA_THINK_OPEN, GEMMA_THINK_CLOSE)}


def think_markers(tool_format: str | None) -> tuple[str, str]:
    return THINK_MARKERS.get(tool_format, (THINK_OPEN, THINK_CLOSE))


def marker_texts(tool_format: str | None, roles) -> dict:
    """role -> text, the thinking's per format (what OutputSpec.markers holds)."""
    opener, close = think_markers(tool_format)
    return {r: opener if r == "think_open" else close if r == "think_close" else MARKER_TEXT[r] for r in roles}


@dataclass(frozen=True, slots=True)
class Marker:
    text: str
    token_id: int | None  # the one token whose text it is (or that opens it, when rest), if there is one
    special: bool  # a special token: decoding drops it unless kept
    rest: str = ""  # the text after that token (Gemma 4's <|channel> then "thought\n")


@dataclass(frozen=True, slots=True)
class ChatFormat:
    tool_format: str | None  # HERMES, LLAMA3_JSON, MISTRAL, HARMONY; None: calls ridge cannot read
    tools_in_template: bool  # False: the template never reads `tools`, and ridge writes their prompt
    reasoning: bool  # the template writes </think>
    markers: dict  # role -> Marker, for the format's markers and the thinking's
    tool_responses: bool = False  # the template reads results from the calling message's tool_responses

    def info(self) -> dict:
        """hello.model.chat (docs/protocol.md §7.1)."""
        return {"tool_format": self.tool_format, "tool_prompt": "template" if self.tools_in_template else "ridge",
                "reasoning": self.reasoning}

    def keep_ids(self) -> tuple[int, ...]:
        """The special tokens whose text the output must keep, so that the parser sees them."""
        return tuple(sorted(m.token_id for m in self.markers.values() if m.special))

    def reasoning_start(self, prompt: str) -> str:
        """Where the output begins: "think" (the prompt opened <think>), "maybe" (the model may open
        it), "content" (no reasoning, or the prompt closed it: thinking turned off)."""
        if not self.reasoning:
            return "content"
        opener, close = (m.text.rstrip() for m in (self.markers["think_open"], self.markers["think_close"]))
        tail = prompt.rstrip()
        if tail.endswith(opener):
            return "think"
        return "content" if tail.endswith(close) else "maybe"

    def messages(self, messages: list[dict]) -> list[dict]:
        """The messages as this template reads them (template_messages' output): a template that reads
        tool_responses (Gemma 4's) gets each run of tool results there, not as role "tool" turns."""
        return gemma_tool_responses(messages) if self.tool_responses else messages


def read_format(template: str | None) -> tuple[str | None, bool]:
    """-> (the tool format, whether the template reads `tools`)."""
    t = template or ""
    reads_tools = re.search(r"\btools\b", t) is not None
    if "<|channel|>" in t:  # gpt-oss: ridge renders harmony itself (hello's tool_prompt "ridge")
        return HARMONY, False
    if "<|tool_call>" in t:  # Gemma 4: call:NAME{key:value}, strings in <|"|>
        return GEMMA4, reads_tools
    if "<tool_call>" in t:  # Qwen3.5 / Qwen3-Coder write XML parameters inside, Qwen2.5 / Qwen3 JSON
        return (QWEN3_XML if "<function=" in t else HERMES), reads_tools
    if "[TOOL_CALLS]" in t:
        return MISTRAL, reads_tools
    if "<|python_tag|>" in t or ("<|start_header_id|>" in t and reads_tools):
        return LLAMA3_JSON, reads_tools
    # A template that never reads tools gets ridge's prompt, in Hermes' format; one that reads them
    # and writes none of the known markers has a format of its own (Granite's, Phi-4's).
    return (None, True) if reads_tools else (HERMES, False)


def chat_format(tokenizer) -> ChatFormat:
    template = tokenizer.chat_template or ""
    fmt, in_template = read_format(template)
    reasoning = fmt == HARMONY or think_markers(fmt)[1] in template
    roles = list(FORMAT_MARKERS.get(fmt, ())) + (["think_open", "think_close"] if reasoning and fmt != HARMONY
                                                 else [])
    markers = {r: marker(tokenizer, t) for r, t in marker_texts(fmt, roles).items()}
    return ChatFormat(fmt, in_template, reasoning, markers, "tool_responses" in template)


def marker(tokenizer, text: str) -> Marker:
    """The marker as the tokenizer holds it: one token, or one special token and plain text after it."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    added = tokenizer.backend.get_added_tokens_decoder()
    if len(ids) == 1:
        return Marker(text, ids[0], bool(ids[0] in added and added[ids[0]].special))
    head = ids and added.get(ids[0])
    if head and head.special and text.startswith(head.content):
        return Marker(text, ids[0], True, text[len(head.content):])
    return Marker(text, None, False)


def gemma_tool_responses(messages: list[dict]) -> list[dict]:
    """Gemma 4's templates read a call's results from `tool_responses` on the assistant message that
    made it ({name, response}), rendering a role "tool" message as a turn of its own that the model
    never saw in training; transformers passes messages through as they are. So each tool message
    joins the calling message: its name from the call its tool_call_id answers (else its own name),
    its content as a map when it is a JSON object, else as its text."""
    out: list[dict] = []
    caller = None  # the index in out of the last assistant message with calls
    for m in messages:
        if m["role"] == "tool" and caller is not None:
            calls = {c.get("id"): c["function"]["name"] for c in out[caller]["tool_calls"]}
            name = calls.get(m.get("tool_call_id")) or m.get("name") or \
                (next(iter(calls.values())) if len(calls) == 1 else "unknown")
            try:
                response = json.loads(m["content"])
            except ValueError:
                response = None
            response = response if isinstance(response, dict) else m["content"]
            prior = out[caller].get("tool_responses", [])
            out[caller] = {**out[caller], "tool_responses": prior + [{"name": name, "response": response}]}
            continue
        caller = len(out) if m["role"] == "assistant" and m.get("tool_calls") else \
            (caller if m["role"] == "tool" else None)
        out.append(m)
    return out


# -- ridge's prompt, for a template that renders no tools ----------------------------------------------
TOOLS_PROMPT = """# Tools

You may call one or more functions to help with the user's request. Their signatures are within <tools></tools>:
<tools>
{tools}
</tools>

To call a function, write a JSON object with its name and arguments within <tool_call></tool_call>:
<tool_call>
{{"name": <function-name>, "arguments": <arguments-json-object>}}
</tool_call>"""


def hermes_block(name: str, arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def ridge_tool_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The chat for a template that renders no tools: their prompt in the system message (when the
    model may call them), earlier calls as Hermes blocks in the assistant's text, results as
    <tool_response> user messages. messages: as template_messages made them (arguments as maps)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            blocks = [hermes_block(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            text = "\n".join(([m["content"]] if m["content"] else []) + blocks)
            out.append({"role": m["role"], "content": text})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        prompt = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# -- system messages among the turns ---------------------------------------------------------------------
def render_chat(apply, messages: list[dict], **kw) -> str:
    """apply(messages, **kw) (a tokenizer's apply_chat_template): a system message after the first
    is rendered where it stands; when the template refuses that ("System message must be at the
    beginning", "roles must alternate") or drops it unread (its text is not in what it wrote), the
    same chat again with each such message folded into a user turn (fold_system). Whatever the
    second render raises is the template's answer."""
    folded = fold_system(messages)
    if folded is None:
        return apply(messages, **kw)
    try:
        text = apply(messages, **kw)
    except Exception:
        return apply(folded, **kw)
    late = (m["content"].strip() for m in messages[1:] if m["role"] == "system")  # templates may trim
    return text if all(c in text for c in late) else apply(folded, **kw)


def fold_system(messages: list[dict]) -> list[dict] | None:
    """Each system message after the first as a note in a user turn, where it stands: joined to the
    end of the user message before it, else to the start of the one after it, else a user message
    of its own (between two assistant turns, or after a tool result). None: there is none to fold.
    Not into the leading system message: that would change the prompt's head whenever a client adds
    one (Claude Code sends them as a session goes on), and the whole conversation's cached prefix with it."""
    if not any(m["role"] == "system" for m in messages[1:]):
        return None
    out: list[dict] = []
    pending: list[str] = []  # notes waiting for the user message after them
    for i, m in enumerate(messages):
        if m["role"] != "system" or i == 0:
            if m["role"] == "user" and pending:
                m = {**m, "content": "\n\n".join(pending + [m["content"]])}
                pending = []
            elif pending:
                out.append({"role": "user", "content": "\n\n".join(pending)})
                pending = []
            out.append(m)
        elif out and out[-1]["role"] == "user" and not pending:
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + m["content"]}
        else:
            pending.append(m["content"])
    if pending:
        out.append({"role": "user", "content": "\n\n".join(pending)})
    return out
