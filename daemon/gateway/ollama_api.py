"""Ollama's request bodies -> the daemon's `generate` and `embed` (the same
Generation the OpenAI and Anthropic routes build: openai_api.py), and the
model's card in Ollama's words. The routes are ollama_routes.py.

Ollama's sampling defaults are its own (temperature 0.8, top_k 40, top_p 0.9),
and a request that leaves them out gets them, as it would from Ollama. An
option that would change the output and that ridge cannot honour is a 400
naming it, as on the OpenAI routes; the runtime's options are ridge's to choose
and are ignored, as Ollama ignores the options it does not know."""
from __future__ import annotations

import hashlib
import hmac
import os

from ridge.durations import FOREVER, parse_duration

from . import images
from .dialects import OLLAMA
from .openai_api import ApiError, Generation, bad, ceiling, dialect_params
from .ollama_schemas import ChatRequest, GenerateRequest, Options

# Ollama's, when a Modelfile sets none, in its words (dialects.OLLAMA holds them in the daemon's).
DEFAULTS = {OLLAMA.api_name(k): v for k, v in OLLAMA.defaults.items()}
UNTIL_FULL = (-1, -2)  # num_predict: no limit / fill the context; both run to the context's end here
PINNED = -1.0  # keep_alive: held until the daemon stops
EFFORTS = ("low", "medium", "high")


def not_found(name: str) -> ApiError:
    return ApiError(404, f"model '{name}' not found", "not_found_error", "model", "model_not_found")


def _bare(name: str) -> str:
    return name.removesuffix(":latest")  # Ollama's default tag: the name without one


async def listing(link) -> list[dict]:
    """The daemon's models (docs/protocol.md §3.10), the default first."""
    await link.refresh()
    return (await link.call("models"))["models"]


async def card(link, name: str | None) -> dict:
    """The model a request names -> what is known of it: `name` (the daemon's), `kind`, and once it
    is loaded (the default always is) hello's map (§7.1). A daemon that knows only its default
    answers any name with it, as the daemon itself does."""
    models = await listing(link)
    wanted = _bare(name or "")
    found = next((m for m in models if _bare(m["name"]) == wanted), None)
    if found is None and len(models) == 1:
        found = models[0]
    if found is None:
        raise not_found(name or "")
    hello = link.model if found["default"] else found.get("model")
    return {**(hello or {}), "name": found["name"], "kind": found.get("kind"), "entry": found}


# -- keep_alive: the daemon's durations (ridge/durations.py), so that config.toml and this API agree --
def keep_alive(value) -> float | None:
    """-> seconds (PINNED for a negative duration: held forever; 0: unloaded after the request),
    None when absent. A number is seconds; a string a duration ("5m", "1h30m", "-1s", "1d")."""
    if value is None:
        return None
    try:
        seconds = parse_duration(value)
    except ValueError as e:
        raise bad(str(e), "keep_alive") from None
    return PINNED if seconds == FOREVER else seconds


# -- options ---------------------------------------------------------------------------------------------
def sampling(options: Options | None, link, model: dict) -> dict:
    """Ollama's options -> the daemon's params (docs/protocol.md §3.2). model: card()'s."""
    o = options or Options()
    max_len = model.get("max_model_len")  # known once the model is loaded; else the daemon's bound holds
    if o.num_ctx is not None and not 1 <= o.num_ctx <= (max_len or o.num_ctx):
        raise bad(f"options.num_ctx: {o.num_ctx} is outside [1, {max_len}], the context ridge serves this model "
                  "with (its max_model_len)", "options")
    params: dict = {}
    if o.num_predict is None or o.num_predict in UNTIL_FULL:
        params["max_tokens"] = max_len or link.limits["max_tokens"]  # the daemon caps it at the room left
    elif o.num_predict < 1:
        raise bad("options.num_predict must be a positive count of tokens, or -1 or -2 (until the context is "
                  "full)", "options")
    else:
        params["max_tokens"] = ceiling(o.num_predict, max_len or link.limits["max_tokens"])
    params.update(dialect_params(OLLAMA, o))  # its defaults where a field is left out
    return params


def response_format(fmt) -> dict | None:
    """format: "json" (any JSON object) or a JSON schema -> params.response_format (§3.2.1)."""
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}


def template_kwargs(think, model: dict) -> dict:
    """think -> the template's variables: a bool turns thinking on or off, an effort names it too."""
    if think is None:
        return {}
    if "chat" in model and not model["chat"].get("reasoning") and think is not False:  # known once loaded
        raise bad(f"\"{model['name']}\" does not support thinking", "think")
    if think in EFFORTS:
        return {"enable_thinking": True, "reasoning_effort": think}
    return {"enable_thinking": bool(think)}


def model_fields(req, model: dict) -> dict:
    """The daemon's `model` and `keep_alive` (§3.10): the name it knows, the duration in seconds."""
    out = {"model": model["name"]}
    if (seconds := keep_alive(req.keep_alive)) is not None:
        out["keep_alive"] = seconds
    return out


def _params(req, link, model: dict) -> dict:
    params = sampling(req.options, link, model)
    if (rf := response_format(req.format)) is not None:
        params["response_format"] = rf
    params.update(model_fields(req, model))
    return params


# -- /api/chat ---------------------------------------------------------------------------------------------
def _calls(i: int, calls) -> list[dict]:
    return [{"id": c.id or f"call_{i}_{j}", "type": "function",
             "function": {"name": c.function.name, "arguments": c.function.arguments}} for j, c in enumerate(calls)]


def _with_images(text: str, given: list[str] | None, where: str, param: str = "messages") -> str | list[dict]:
    """A message's text and its base64 images -> the daemon's content: the images first, then the
    text, as Ollama renders a message's images ahead of its words."""
    if not given:
        return text
    parts = [images.from_base64(b, f"{where}[{j}]", param) for j, b in enumerate(given)]
    return parts + ([{"type": "text", "text": text}] if text else [])


def chat_messages(req: ChatRequest) -> list[dict]:
    """Ollama's messages -> the daemon's (§3.2.3): an assistant's calls get ids, and a tool's result
    names the latest call of its tool_name that nothing has answered yet."""
    out, open_calls = [], []
    for i, m in enumerate(req.messages):
        msg: dict = {"role": m.role, "content": _with_images(m.content or "", m.images, f"messages[{i}].images")}
        if m.thinking:
            msg["reasoning_content"] = m.thinking
        if m.tool_calls:
            msg["tool_calls"] = _calls(i, m.tool_calls)
            msg["content"] = m.content or None
            open_calls.extend(msg["tool_calls"])
        if m.role == "tool":
            answered = m.tool_call_id or next((c["id"] for c in reversed(open_calls)
                                               if c["function"]["name"] == m.tool_name), None)
            open_calls = [c for c in open_calls if c["id"] != answered]
            if answered:
                msg["tool_call_id"] = answered
            if m.tool_name:
                msg["name"] = m.tool_name
        out.append(msg)
    return out


def chat_request(req: ChatRequest, link, model: dict) -> Generation:
    prompt: dict = {"messages": chat_messages(req)}
    if req.tools:
        prompt["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
    if kwargs := template_kwargs(req.think, model):
        prompt["chat_template_kwargs"] = kwargs
    return Generation([prompt], _params(req, link, model), req.stream is not False)


# -- /api/generate -----------------------------------------------------------------------------------------
def generate_request(req: GenerateRequest, link, model: dict) -> Generation:
    for key in ("suffix", "template"):
        if getattr(req, key):
            raise bad(f"{key} is not supported by ridge (only empty)", key)
    if req.context:
        raise bad("context is not supported by ridge: send the conversation as messages to /api/chat", "context")
    params = _params(req, link, model)
    if req.raw or not model.get("chat_template", True):  # a model not loaded yet: as most, it has one
        if req.system:
            raise bad("system needs the model's chat template (not with raw, nor a model without one)", "system")
        if req.think is not None:
            raise bad("think needs the model's chat template (not with raw, nor a model without one)", "think")
        if req.images:
            raise bad("images need the model's chat template (not with raw, nor a model without one)", "images")
        return Generation([{"prompt": req.prompt}], params, req.stream is not False)
    messages = ([{"role": "system", "content": req.system}] if req.system else []) + \
        [{"role": "user", "content": _with_images(req.prompt, req.images, "images", "images")}]
    prompt: dict = {"messages": messages}
    if kwargs := template_kwargs(req.think, model):
        prompt["chat_template_kwargs"] = kwargs
    return Generation([prompt], params, req.stream is not False)


# -- the model's card --------------------------------------------------------------------------------------
def capabilities(model: dict) -> list[str]:
    """What Ollama's clients ask before they send a request: completion, tools, thinking, embedding
    (tools and thinking known once the model is loaded: its chat template says)."""
    if model.get("pooling") or model.get("kind") == "embed":
        return ["embedding"]
    chat = model.get("chat") or {}
    out = ["completion"]
    if chat.get("tool_format"):
        out.append("tools")
    if chat.get("reasoning"):
        out.append("thinking")
    return out


def details(model: dict) -> dict:
    """card()'s -> Ollama's details; arch and weights known once the model is loaded."""
    weights = "FP8" if model.get("quantized") else model.get("weights", "").upper()
    arch = model.get("arch", "")
    return {"parent_model": "", "format": model["entry"].get("format", ""), "family": arch,
            "families": [arch] if arch else None, "parameter_size": "", "quantization_level": weights}


# HTTP clients are not the daemon's owner: they see a model's name, never where its file is, its
# size or its time (docs/service.md). Its digest changes with the file but, keyed by this secret,
# cannot be checked against a guessed path or time.
_DIGEST_KEY = os.urandom(16)


def digest(entry: dict) -> str:
    """A name for a model's current file (Ollama's is its manifest's sha256)."""
    text = f"{entry.get('path')}\0{entry['name']}\0{entry.get('size')}\0{entry.get('modified_at')}"
    return hmac.new(_DIGEST_KEY, text.encode(), hashlib.sha256).hexdigest()


def model_info(model: dict) -> dict:
    arch = model.get("arch")
    if arch is None:  # not loaded: nothing read from its files yet
        return {"general.name": model["name"]}
    info = {"general.architecture": arch, "general.name": model["name"],
            f"{arch}.context_length": model["max_model_len"], f"{arch}.embedding_length": model["hidden_size"],
            f"{arch}.block_count": model["num_layers"], f"{arch}.attention.head_count": model["num_heads"],
            f"{arch}.attention.head_count_kv": model["num_kv_heads"], f"{arch}.attention.key_length":
            model["head_dim"], f"{arch}.vocab_size": model["vocab_size"]}
    if model.get("pooling"):
        info[f"{arch}.pooling_type"] = model["pooling"]
    return info


def parameters(model: dict) -> str:
    """The Modelfile's PARAMETER lines: Ollama's defaults, which requests here start from."""
    lines = [f"{k:<16}{v}" for k, v in DEFAULTS.items()]
    if model.get("max_model_len"):
        lines.append(f"{'num_ctx':<16}{model['max_model_len']}")
    return "\n".join(lines)
