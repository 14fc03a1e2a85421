"""A client's image bytes -> an RGB picture, every bound checked before a pixel is decoded.

Torch-free (Pillow and numpy): the gateway decodes and counts an image's tokens
without the engine. The order is the defence: the encoded size first, then the
format, size and mode read from the header by `Image.open` (which decodes no
pixels), and only then `load()`. A decompression bomb (a small file declaring a
huge canvas) is refused by its header; a truncated file by Pillow's own check,
which ridge never relaxes (`ImageFile.LOAD_TRUNCATED_IMAGES` stays False).

Animated GIF and WebP: the first frame only, as transformers' processors take a
PIL image (its current frame); later frames are never decoded. EXIF orientation
is not applied, as transformers' processors do not transpose either: the model
sees the stored pixels in both."""
from __future__ import annotations

import base64
import binascii
import io
import warnings
from dataclasses import dataclass

from PIL import Image, ImageFile

from ridge.errors import InvalidRequest

# Pillow's names (Image.format); MPO is a JPEG holding several pictures (phone cameras).
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
OPENED_AS = {"MPO": "JPEG"}
MIB = 2**20


@dataclass(frozen=True, slots=True)
class ImageLimits:
    max_bytes: int = 20 * MIB  # encoded, as sent
    min_side: int = 4  # a 1x1 or 3x3 picture carries nothing a model can read
    max_side: int = 16_384
    max_pixels: int = 50_000_000  # width x height: 200 MB of RGB once decoded

    def __post_init__(self):
        assert 1 <= self.min_side <= self.max_side and self.max_pixels >= self.min_side**2 and self.max_bytes > 0
        # Pillow warns from MAX_IMAGE_PIXELS on: with ridge's bound below it, anything Pillow
        # calls a bomb ridge has refused already, whatever the warning filters say.
        assert self.max_pixels <= (Image.MAX_IMAGE_PIXELS or self.max_pixels)


@dataclass(frozen=True, slots=True)
class ImageHeader:
    format: str  # one of FORMATS
    width: int
    height: int
    mode: str  # Pillow's mode before conversion: RGB, RGBA, P, L, LA, CMYK, ...


def _bomb(e: Exception, limits: ImageLimits) -> InvalidRequest:
    return InvalidRequest(f"image refused: its header declares more than the {limits.max_pixels} pixels "
                          f"accepted (Pillow: {e})")


def _open(data: bytes, limits: ImageLimits) -> Image.Image:
    # Pillow checks the declared size against its own bomb limit inside open(); its warning
    # (the lower threshold) becomes an error too. ridge's own bounds, lower still, follow in _check.
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data), formats=FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise _bomb(e, limits) from None
    except Image.UnidentifiedImageError:
        raise InvalidRequest(f"not an image in an accepted format ({', '.join(FORMATS)})") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise InvalidRequest(f"the image's header cannot be read: {e}") from None


def _check(im: Image.Image, limits: ImageLimits) -> ImageHeader:
    fmt = OPENED_AS.get(im.format, im.format)
    if fmt not in FORMATS:
        raise InvalidRequest(f"image format {im.format} is not accepted ({', '.join(FORMATS)})")
    w, h = im.size
    if min(w, h) < limits.min_side:
        raise InvalidRequest(f"image is {w}x{h}: each side must be at least {limits.min_side} pixels")
    if max(w, h) > limits.max_side:
        raise InvalidRequest(f"image is {w}x{h}: each side must be at most {limits.max_side} pixels")
    if w * h > limits.max_pixels:
        raise InvalidRequest(f"image is {w}x{h} = {w * h} pixels: at most {limits.max_pixels} are accepted")
    return ImageHeader(fmt, w, h, im.mode)


def _check_bytes(data: bytes, limits: ImageLimits) -> None:
    if len(data) > limits.max_bytes:
        raise InvalidRequest(f"image is {len(data)} bytes: at most {limits.max_bytes} are accepted")
    if not data:
        raise InvalidRequest("image is empty")


def probe_image(data: bytes, limits: ImageLimits = ImageLimits()) -> ImageHeader:
    """The format and size from the header, every bound checked; no pixel decoded (for token counts)."""
    _check_bytes(data, limits)
    with _open(data, limits) as im:
        return _check(im, limits)


def to_rgb(im: Image.Image) -> Image.Image:
    """transformers' convert_to_rgb: transparency composited onto white, any other mode converted
    (CMYK, P, L, I;16...), so the pixels a processor sees are the ones transformers would."""
    if "A" in im.getbands() or im.info.get("transparency") is not None:
        rgba = im.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return im if im.mode == "RGB" else im.convert("RGB")


def decode_image(data: bytes, limits: ImageLimits = ImageLimits()) -> Image.Image:
    """Encoded bytes -> an RGB image (its first frame), or InvalidRequest naming the bound or the fault."""
    _check_bytes(data, limits)
    if ImageFile.LOAD_TRUNCATED_IMAGES:  # a process-wide switch some library may have flipped
        raise RuntimeError("PIL.ImageFile.LOAD_TRUNCATED_IMAGES is set: truncated images would decode as grey")
    with _open(data, limits) as im:
        _check(im, limits)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                im.load()  # the current frame: the first, as opened
                return to_rgb(im)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise _bomb(e, limits) from None
        except (OSError, SyntaxError, ValueError, EOFError) as e:
            raise InvalidRequest(f"the image cannot be decoded (truncated or corrupt): {e}") from None


# Data URLs -------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class RemoteImage:
    """An http(s) image URL the operator allows fetching; the fetch is the caller's."""
    url: str


def parse_data_url(url: str, limits: ImageLimits = ImageLimits()) -> bytes:
    """`data:image/png;base64,....` -> the bytes. The size is checked on the text before decoding it."""
    head, comma, payload = url.partition(",")
    if not head.lower().startswith("data:") or not comma:
        raise InvalidRequest("a data URL has the form data:image/<type>;base64,<data>")
    params = [p.strip().lower() for p in head[5:].split(";")]
    if not params[0].startswith("image/"):
        raise InvalidRequest(f"data URL media type {params[0] or '(none)'!r} is not an image/* type")
    if "base64" not in params[1:]:
        raise InvalidRequest("an image data URL must be base64-encoded (data:image/<type>;base64,...)")
    payload = "".join(payload.split())  # line breaks are allowed inside base64 in the wild
    if len(payload) // 4 * 3 > limits.max_bytes + 2:
        raise InvalidRequest(f"image is about {len(payload) // 4 * 3} bytes: at most {limits.max_bytes} are accepted")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest("the data URL's base64 payload is malformed") from None


def parse_image_url(url: str, *, allow_remote: bool = False,
                    limits: ImageLimits = ImageLimits()) -> bytes | RemoteImage:
    """An image part's URL: a data URL's bytes, or an http(s) URL when the operator allows fetching.

    Off by default: a system daemon must not fetch URLs for its clients (it would reach the
    operator's network on anyone's behalf)."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return parse_data_url(url, limits)
    if scheme in ("http", "https"):
        if not allow_remote:
            raise InvalidRequest("remote image URLs are refused: this daemon does not fetch URLs for its "
                                 "clients; send the image inline as a data: URL (base64), or ask the "
                                 "operator to turn on image fetching")
        return RemoteImage(url)
    raise InvalidRequest(f"image URL scheme {scheme or '(none)'!r} is not accepted: use a data: URL"
                         + (" or http(s)" if allow_remote else ""))
