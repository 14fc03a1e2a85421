"""Images in the HTTP APIs -> the daemon's image frames (docs/protocol.md §3.2.5).

Each dialect's translator writes an image where it stands in a message as
{"type": "image", "image": SOURCE}, SOURCE being the decoded bytes of a data
URL or base64 field, or a RemoteImage (an http(s) URL). `attach` then numbers
them in the conversation's order, fetches the remote ones when the operator
allows it, and puts the bytes in the generate's `images`, which the protocol
client sends as frames. The daemon decodes and bounds every image; the gateway
only bounds what it reads (the size of a fetch).

Remote URLs are refused unless `allow_image_urls` is on: the gateway would
otherwise reach the operator's network (and whatever it can see) on any
client's behalf."""
from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

from ridge.errors import InvalidRequest
from ridge.vision.decode import ImageLimits, RemoteImage, parse_data_url, parse_image_url

from .errors import ApiError, bad
from .settings import FETCH_TIMEOUT_S

LIMITS = ImageLimits()
IMAGE = "image"


def from_url(url: str, where: str, param: str = "messages") -> dict:
    """An image part from an image URL: a data: URL's bytes, or an http(s) URL to fetch later."""
    try:
        return {"type": IMAGE, IMAGE: parse_image_url(url, allow_remote=True, limits=LIMITS)}
    except InvalidRequest as e:
        raise bad(f"{where}: {e}", param) from None


def from_base64(data: str, where: str, param: str = "messages", media_type: str = "image/png") -> dict:
    """An image part from a bare base64 field (Anthropic's base64 source, Ollama's images)."""
    if data.startswith("data:"):
        return from_url(data, where, param)
    try:
        return {"type": IMAGE, IMAGE: parse_data_url(f"data:{media_type};base64,{data}", LIMITS)}
    except InvalidRequest as e:
        raise bad(f"{where}: {e}", param) from None


def joined(parts: list[dict]) -> str | list[dict]:
    """A message's parts as the daemon takes them: text alone joined (as before images), else the
    array of text and image parts."""
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def text_only(messages: list[dict]) -> list[dict]:
    """The messages with their image parts left out (what tokenize, which takes no images, renders)."""
    return [{**m, "content": joined([p for p in m["content"] if p["type"] != IMAGE])}
            if isinstance(m.get("content"), list) else m for m in messages]


def _numbered(messages: list[dict]) -> tuple[list[dict], list]:
    sources, out = [], []
    for m in messages:
        if isinstance(m.get("content"), list):
            parts = []
            for p in m["content"]:
                if p["type"] == IMAGE:
                    sources.append(p[IMAGE])
                    p = {"type": IMAGE, IMAGE: len(sources) - 1}
                parts.append(p)
            m = {**m, "content": parts}
        out.append(m)
    return out, sources


async def attach(request, gen) -> None:
    """The image parts of gen's messages (an openai_api.Generation) numbered, their bytes (fetched
    where remote) in gen.params["images"]."""
    prompt = gen.prompts[0]
    if "messages" not in prompt:
        return
    prompt["messages"], sources = _numbered(prompt["messages"])
    if not sources:
        return
    settings = getattr(request.app.state, "settings", None)
    allowed = bool(getattr(settings, "allow_image_urls", False))
    gen.params["images"] = [await fetched(s, allowed) if isinstance(s, RemoteImage) else s for s in sources]


async def fetched(image: RemoteImage, allowed: bool) -> bytes:
    if not allowed:
        try:
            parse_image_url(image.url, allow_remote=False)
        except InvalidRequest as e:
            raise bad(str(e), "messages") from None
    try:
        return await asyncio.wait_for(asyncio.to_thread(_fetch, image.url), FETCH_TIMEOUT_S)
    except TimeoutError:
        raise bad(f"the image at {image.url[:200]} did not arrive within {FETCH_TIMEOUT_S:g} s", "messages") from None


def _fetch(url: str) -> bytes:
    """GET url, at most LIMITS.max_bytes within FETCH_TIMEOUT_S; a failure is the client's 400."""
    req = urllib.request.Request(url, headers={"User-Agent": "ridge-gateway", "Accept": "image/*"})
    try:
        with urllib.request.urlopen(req, timeout=FETCH_TIMEOUT_S) as r:
            data = r.read(LIMITS.max_bytes + 1)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ApiError(400, f"the image at {url[:200]} could not be fetched: {e}", param="messages",
                       code="invalid_request") from None
    if len(data) > LIMITS.max_bytes:
        raise bad(f"the image at {url[:200]} is over {LIMITS.max_bytes} bytes, the limit", "messages")
    return data
