"""A generate's images (docs/protocol.md §3.2.5): the image frames decoded and bounded, each
preprocessed as the model's processor does, its marker in the prompt expanded, and the encoder
inputs located in the tokenized prompt (ridge/vision/prompt.py).

Runs on the admission workers, inside Validator.generate: decoding and preprocessing cost CPU in
proportion to the image, never on the socket thread. Plain data in, plain data out."""
from __future__ import annotations

from dataclasses import dataclass

from ridge.errors import InvalidRequest
from ridge.vision.decode import ImageLimits, decode_image
from ridge.vision.pixels import PreprocessorConfigError
from ridge.models.mmproj import mmproj_prompt_rules
from ridge.vision.prompt import Expanded, place, read_prompt_rules

from ..protocol import INVALID_REQUEST, ProtocolError, fail

TEXT, IMAGE = "text", "image"


@dataclass(frozen=True, slots=True)
class ImageRefs:
    """A chat's messages with their image parts: `checked` holds each part list as its text (what
    the message checks read), `rendered` the lists the chat template renders, `order` the image
    each image part names, in the order the template writes them."""
    checked: list[dict]
    rendered: list[dict]
    order: list[int]


def split_parts(messages, count: int, rid: str | None) -> ImageRefs:
    """Content arrays of text and image parts -> ImageRefs. An image part is {"type": "image",
    "image": i}, i indexing the request's images; only user messages hold them, and every image
    sent is named at least once."""
    if not isinstance(messages, list):
        return ImageRefs(messages, messages, [])
    checked, rendered, order = [], [], []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            checked.append(m), rendered.append(m)
            continue
        where = f"messages[{i}].content"
        parts, texts = [], []
        for j, p in enumerate(content):
            kind = p.get("type") if isinstance(p, dict) else None
            if kind == TEXT and set(p) == {"type", "text"} and isinstance(p["text"], str):
                parts.append(p), texts.append(p["text"])
            elif kind == IMAGE and set(p) == {"type", "image"} and _index(p["image"], count):
                if m.get("role") != "user":
                    raise fail(f"{where}[{j}]", "a text part (images go in user messages)", rid)
                parts.append({"type": IMAGE}), order.append(p["image"])
            else:
                raise fail(f"{where}[{j}]", '{"type": "text", "text": T} or {"type": "image", "image": I}, '
                           f"I indexing the request's {count} image(s)", rid)
        text = "\n".join(texts)
        checked.append({**m, "content": text})
        rendered.append({**m, "content": parts} if len(parts) > len(texts) else {**m, "content": text})
    if missing := sorted(set(range(count)) - set(order)):
        raise fail("images", f"named by an image part (image {missing[0]} is named by none)", rid)
    return ImageRefs(checked, rendered, order)


def _index(i, count: int) -> bool:
    return isinstance(i, int) and not isinstance(i, bool) and 0 <= i < count


def decode_all(frames: list[bytes], limits: ImageLimits, rid: str | None) -> list:
    """Each image frame -> an RGB picture; a refusal names the image and the bound it broke."""
    out = []
    for i, data in enumerate(frames):
        try:
            out.append(decode_image(bytes(data), limits))
        except InvalidRequest as e:
            raise ProtocolError(INVALID_REQUEST, f"images[{i}]: {e}", rid) from None
    return out


def expand_all(rules, pictures: list, rid: str | None) -> list[Expanded]:
    out = []
    for i, im in enumerate(pictures):
        try:
            out.append(rules.expand(im))
        except InvalidRequest as e:
            raise ProtocolError(INVALID_REQUEST, f"images[{i}]: {e}", rid) from None
    return out


def expand_markers(text: str, marker: str, expanded: list[Expanded], raw: bool, rid: str | None) -> str:
    """Each marker in `text`, in order, replaced by its image's text; their count must match.
    raw: a client's prompt (its markers are its own), else a rendered chat (the template's)."""
    pieces = text.split(marker)
    if (found := len(pieces) - 1) != len(expanded):
        fix = f"mark each image's place with {marker}" if raw else "the text must not spell the marker itself"
        raise ProtocolError(INVALID_REQUEST, f"{'prompt' if raw else 'the rendered chat'} holds {found} image "
                            f"marker(s) {marker} and the request places {len(expanded)} image(s): {fix}", rid)
    out = [pieces[0]]
    for e, piece in zip(expanded, pieces[1:]):
        out += [e.text, piece]
    return "".join(out)


def located(ids: list[int], expanded: list[Expanded], token_id: int, rid: str | None) -> tuple:
    try:
        return place(ids, expanded, token_id)
    except InvalidRequest as e:
        raise ProtocolError(INVALID_REQUEST, str(e), rid) from None


def rules_for(model_dir, mmproj=None, tokenizer=None) -> object:
    """The image prompt rules of a model directory (ridge/vision/prompt.py), or of a GGUF model's
    projector file (models/mmproj.py: its tokens' ids from the tokenizer); None when it has no
    image processor; the reason, as a string, when its preprocessing is one ridge cannot honour
    exactly (its text is still served: only its images are refused, naming the field)."""
    try:
        if mmproj is not None:
            return mmproj_prompt_rules(mmproj, tokenizer.backend.token_to_id)
        return read_prompt_rules(model_dir)
    except (PreprocessorConfigError, ValueError) as e:
        return str(e)
