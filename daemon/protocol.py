"""Wire format of docs/protocol.md: msgpack maps in single ZeroMQ frames, and a generate's
images as raw frames after its map (§3.2.5).

Everything here is plain data in, plain data out: decoding a frame into a
checked message, and building the daemon's replies. No sockets, no engine."""
from __future__ import annotations

from dataclasses import dataclass, field

import msgpack

from ridge.request import MAX_IMAGE_BYTES, MAX_IMAGES, is_int, is_num  # noqa: F401 (the wire's number rules)

VERSION = 5  # 2: tool calls and reasoning (docs/protocol.md §3.2.3); 3: embed (§3.9); 4: rerank (§3.11);
#              5: images (§3.2.5)
SUPPORTED = (1, 2, 3, 4, 5)
# The version each feature came in: the one place a version gate's number is written. A message in
# an older version may not use the feature (a refusal naming the version), and a peer speaking an
# older one is not sent its frames.
SINCE = {
    "tools": 2,  # tool calls and results, reasoning, tools / tool_choice / parallel_tool_calls /
    #              chat_template_kwargs, params.max_reasoning_tokens (§3.2.3)
    "embed": 3,  # the embed message (§3.9)
    "models": 3,  # model and keep_alive fields, the models message, loading events (§3.10)
    "rerank": 4,  # the rerank message (§3.11)
    "images": 5,  # a generate's image frames, its images count and image parts in messages (§3.2.5)
}
PUB_TOPIC = b"stats"
MAX_ID_BYTES = 128
MAX_MESSAGES = 1024
MAX_DEPTH = 32
MAX_EMBED_INPUTS = 2048  # inputs in one embed (OpenAI's limit)
MAX_IMAGE_FRAME_BYTES = 20 << 20  # one image, encoded: ridge/vision/decode.ImageLimits.max_bytes (Pillow-free here)

CLIENT_TYPES = ("hello", "generate", "abort", "tokenize", "detokenize", "stats", "health", "heartbeat", "embed",
                "models", "rerank")
FINISH_REASONS = ("stop", "length", "abort", "error", "tool_calls")

# error codes (docs/protocol.md §5)
BAD_FRAME = "bad_frame"
TOO_LARGE = "too_large"
BAD_MSGPACK = "bad_msgpack"
BAD_UTF8 = "bad_utf8"
MISSING_FIELD = "missing_field"
INVALID_FIELD = "invalid_field"
UNSUPPORTED_VERSION = "unsupported_version"
UNKNOWN_TYPE = "unknown_type"
INVALID_REQUEST = "invalid_request"
DUPLICATE_ID = "duplicate_id"
TOO_MANY_REQUESTS = "too_many_requests"
BUSY = "busy"
SHUTTING_DOWN = "shutting_down"
INTERNAL = "internal"
MODEL_NOT_FOUND = "model_not_found"  # a generate or embed named a model the daemon does not know (§3.10)
MODEL_LOAD_FAILED = "model_load_failed"
ERROR_CODES = (BAD_FRAME, TOO_LARGE, BAD_MSGPACK, BAD_UTF8, MISSING_FIELD, INVALID_FIELD, UNSUPPORTED_VERSION,
               UNKNOWN_TYPE, INVALID_REQUEST, DUPLICATE_ID, TOO_MANY_REQUESTS, BUSY, SHUTTING_DOWN, INTERNAL,
               MODEL_NOT_FOUND, MODEL_LOAD_FAILED)


class ProtocolError(Exception):
    def __init__(self, code: str, message: str, request_id: str | None = None, **extra):
        super().__init__(message)
        self.code, self.message, self.request_id, self.extra = code, message, request_id, extra


@dataclass(slots=True, kw_only=True)
class Limits:
    """What hello announces. The fields that are options take their values from `ridge serve`'s
    resolved options (daemon/cli/serve.py, limits): their defaults live only in daemon/cli/config.py."""
    max_frame_bytes: int
    max_prompt_tokens: int  # fitted to the context: at most its length - 1
    max_tokens: int  # at most the context length
    max_n: int = 64
    max_requests_per_client: int
    max_queue: int
    max_id_bytes: int = MAX_ID_BYTES
    max_messages: int = MAX_MESSAGES

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


# -- encoding ------------------------------------------------------------------
def pack(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def speaks(v: int, feature: str) -> bool:
    """Whether version v has the feature (SINCE)."""
    return v >= SINCE[feature]


def too_old(feature: str, v: int, rid: str | None) -> ProtocolError:
    """A message type that came in a later version than the one it was sent in."""
    return ProtocolError(UNKNOWN_TYPE, f"{feature} is a version {SINCE[feature]} message; this one is version {v}",
                         rid)


def message(type_: str, request_id: str | None = None, *, v: int = VERSION, **fields) -> dict:
    """v: the version of the message it answers (a reply is in the client's version)."""
    m = {"v": v, "type": type_}
    if request_id is not None:
        m["id"] = request_id
    m.update(fields)
    return m


def error(code: str, text: str, request_id: str | None = None, **extra) -> dict:
    return {"v": VERSION, "type": "error", "id": request_id, "code": code, "message": text, **extra}


# -- decoding ------------------------------------------------------------------
def _no_ext(code, data):
    raise ValueError("extension types are not part of the protocol")


def _unpackb(frame: bytes, max_frame_bytes: int, raw: bool):
    return msgpack.unpackb(frame, raw=raw, strict_map_key=True, use_list=True, ext_hook=_no_ext,
                           max_str_len=max_frame_bytes, max_bin_len=max_frame_bytes,
                           max_array_len=max_frame_bytes, max_map_len=max_frame_bytes, max_ext_len=0)


def unpack(frame: bytes, max_frame_bytes: int) -> dict:
    """One client frame -> a map (check_plain then vets its contents). Raises ProtocolError, carrying
    the frame's id when one can still be read (salvage_id)."""
    if len(frame) > max_frame_bytes:
        raise ProtocolError(TOO_LARGE, f"frame of {len(frame)} bytes; the limit is {max_frame_bytes}")
    try:
        obj = _unpackb(frame, max_frame_bytes, raw=False)
    except UnicodeDecodeError as e:
        raise ProtocolError(BAD_UTF8, f"a string is not valid UTF-8 ({e.reason} at byte {e.start})",
                            salvage_id(frame, max_frame_bytes)) from None
    except Exception as e:  # msgpack raises several types (ExtraData, FormatError, StackError, ValueError...)
        raise ProtocolError(BAD_MSGPACK, f"not msgpack: {type(e).__name__}: {e}"[:300],
                            salvage_id(frame, max_frame_bytes)) from None
    if not isinstance(obj, dict):
        raise ProtocolError(BAD_MSGPACK, f"the top level must be a map, got {_kind(obj)}")
    return obj


def salvage_id(frame: bytes, max_frame_bytes: int) -> str | None:
    """The `id` of a frame that failed to decode, if it still reads as a UTF-8 string: a bad string
    elsewhere in the map, or bytes after it, must not hide which request the error belongs to."""
    try:
        obj = _unpackb(frame, max_frame_bytes, raw=True)  # strings stay bytes: nothing is decoded
    except msgpack.ExtraData as e:
        obj = e.unpacked
    except Exception:
        return None
    rid = obj.get(b"id") if isinstance(obj, dict) else None
    try:
        return rid.decode() if isinstance(rid, bytes) and rid else None
    except UnicodeDecodeError:
        return None


def check_plain(msg: dict, rid: str | None = None) -> None:
    """Only nil, bool, int, float, str, arrays and maps with string keys, nested at most MAX_DEPTH."""
    try:
        _check_plain(msg, 0)
    except ProtocolError as e:
        e.request_id = rid
        raise


_PLAIN = (type(None), bool, int, float, str, list, dict)


def _check_plain(obj, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ProtocolError(BAD_MSGPACK, f"nesting deeper than {MAX_DEPTH}")
    if isinstance(obj, (bytes, bytearray)):
        raise ProtocolError(BAD_MSGPACK, "binary values are not part of the protocol; send strings as str")
    if not isinstance(obj, _PLAIN):  # e.g. msgpack.Timestamp: extension types are not part of the protocol
        raise ProtocolError(BAD_MSGPACK, f"{type(obj).__name__} values are not part of the protocol")
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise ProtocolError(BAD_MSGPACK, "map keys must be strings")
            _check_plain(v, depth + 1)
    elif isinstance(obj, list):
        for v in obj:
            _check_plain(v, depth + 1)


def _kind(x) -> str:
    return {bool: "bool", int: "int", float: "float", str: "str", list: "array", dict: "map",
            type(None): "nil"}.get(type(x), type(x).__name__)


def request_id_of(msg: dict) -> str | None:
    """The message's id if it is a valid one (1-MAX_ID_BYTES bytes), else None."""
    rid = msg.get("id")
    if isinstance(rid, str) and 0 < len(rid.encode()) <= MAX_ID_BYTES:
        return rid
    return None


def reply_id_of(msg: dict) -> str | None:
    """The id an error reply echoes: any non-empty string id, even an invalid (too long) one, so
    that a client with several requests on one socket can tell which one failed."""
    rid = msg.get("id")
    return rid if isinstance(rid, str) and rid else None


# -- field checks ----------------------------------------------------------------
def fail(name: str, want: str, rid: str | None) -> ProtocolError:
    return ProtocolError(INVALID_FIELD, f"{name} must be {want}", rid)


def check_keys(msg: dict, allowed: set[str], rid: str | None, where: str = "") -> None:
    unknown = set(msg) - allowed
    if unknown:
        names = ", ".join(sorted(f"{where}{k}" for k in unknown))
        raise ProtocolError(INVALID_FIELD, f"unknown field(s) {names} for this message", rid)


def token_list(x, name: str, vocab: int, rid: str | None, max_len: int) -> list[int]:
    if not isinstance(x, list) or not all(is_int(t) and 0 <= t < vocab for t in x):
        raise fail(name, f"an array of integer token ids in [0, {vocab})", rid)
    if len(x) > max_len:
        raise fail(name, f"at most {max_len} ids long", rid)
    return x


@dataclass(slots=True)
class Envelope:
    type: str
    id: str | None
    body: dict = field(default_factory=dict)
    v: int = VERSION  # the version the message speaks
    frames: list = field(default_factory=list)  # a generate's image frames, in order (§3.2.5)


def image_frames(body: dict, frames: list, v: int, t: str, rid: str | None) -> list:
    """The frames after a message's map: a generate's images (version 5 on), as many as its
    `images` says, each within MAX_IMAGE_FRAME_BYTES and all within MAX_IMAGE_BYTES."""
    if not frames:
        return []
    if t != "generate" or not speaks(v, "images"):
        raise ProtocolError(BAD_FRAME, f"a {t} message is exactly one frame; got {1 + len(frames)} (image frames "
                            f"follow only a generate, from version {SINCE['images']})", rid)
    n = body.get("images")
    if not is_int(n) or n != len(frames):
        raise ProtocolError(BAD_FRAME, f"{len(frames)} image frame(s) follow the message and its images field "
                            f"says {n!r}", rid)
    if len(frames) > MAX_IMAGES:
        raise fail("images", f"at most {MAX_IMAGES}", rid)
    if (big := max(len(f) for f in frames)) > MAX_IMAGE_FRAME_BYTES:
        raise ProtocolError(TOO_LARGE, f"an image frame of {big} bytes; the limit is {MAX_IMAGE_FRAME_BYTES}", rid)
    if (total := sum(len(f) for f in frames)) > MAX_IMAGE_BYTES:
        raise ProtocolError(TOO_LARGE, f"image frames of {total} bytes together; the limit is {MAX_IMAGE_BYTES}", rid)
    return list(frames)


def envelope(msg: dict, frames: list = ()) -> Envelope:
    """Checks v, type and id, and the image frames after the map. Raises ProtocolError."""
    rid = reply_id_of(msg)
    if "v" not in msg:
        raise ProtocolError(MISSING_FIELD, "v (the protocol version) is required", rid)
    if not is_int(msg["v"]):
        raise fail("v", "an integer", rid)
    if msg["v"] not in SUPPORTED:
        raise ProtocolError(UNSUPPORTED_VERSION, f"protocol version {msg['v']} is not supported; "
                            f"this daemon speaks {list(SUPPORTED)}", rid, supported=list(SUPPORTED))
    if "type" not in msg:
        raise ProtocolError(MISSING_FIELD, "type is required", rid)
    t = msg["type"]
    if not isinstance(t, str):
        raise fail("type", "a string", rid)
    if t not in CLIENT_TYPES:
        raise ProtocolError(UNKNOWN_TYPE, f"unknown message type {t[:64]!r}; known: {', '.join(CLIENT_TYPES)}", rid)
    if "id" in msg and request_id_of(msg) is None:
        raise fail("id", f"a string of 1-{MAX_ID_BYTES} bytes", rid)
    if t in ("generate", "abort", "embed", "rerank") and rid is None:
        raise ProtocolError(MISSING_FIELD, f"id is required on {t}", None)
    body = {k: v for k, v in msg.items() if k not in ("v", "type", "id")}
    return Envelope(t, rid, body, msg["v"], image_frames(body, list(frames), msg["v"], t, rid))
