"""Image decoding (ridge/vision/decode.py): every bound refused with InvalidRequest before pixels are
decoded, and what passes equals what transformers' processors see (their convert_to_rgb)."""
from __future__ import annotations

import base64
import io
import struct
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile
from transformers.image_transforms import convert_to_rgb

from ridge.errors import InvalidRequest
from ridge.vision import ImageLimits, RemoteImage, decode_image, parse_data_url, parse_image_url, probe_image

rng = np.random.default_rng(42)


def encode(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def noise(w: int, h: int, mode: str = "RGB") -> Image.Image:
    bands = len(Image.new(mode, (1, 1)).getbands())
    a = rng.integers(0, 256, (h, w, bands), dtype=np.uint8)
    return Image.fromarray(a[..., 0] if bands == 1 else a, mode)


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_header_only(width: int, height: int, idat: bytes = b"") -> bytes:
    """A PNG whose IHDR declares width x height (8-bit greyscale), with whatever IDAT is given: the
    header a bomb or a giant shows, without building its pixels."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + (png_chunk(b"IDAT", idat) if idat else b"")
            + png_chunk(b"IEND", b""))


def refused(data: bytes, match: str, limits: ImageLimits = ImageLimits()):
    with pytest.raises(InvalidRequest, match=match):
        decode_image(data, limits)


def test_formats_decode_to_the_pixels_sent():
    im = noise(37, 23)
    for fmt in ("PNG", "BMP", "GIF", "WEBP"):
        kw = {"lossless": True} if fmt == "WEBP" else {}
        data = encode(im if fmt != "GIF" else im.convert("P"), fmt, **kw)
        out = decode_image(data)
        assert out.mode == "RGB" and out.size == (37, 23)
        expect = np.asarray(im.convert("P").convert("RGB") if fmt == "GIF" else im)
        assert np.array_equal(np.asarray(out), expect), fmt
    jpeg = encode(im, "JPEG", quality=90)
    assert np.array_equal(np.asarray(decode_image(jpeg)), np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB")))
    assert probe_image(jpeg).format == "JPEG" and (probe_image(jpeg).width, probe_image(jpeg).height) == (37, 23)


def test_modes_convert_to_rgb_as_transformers_processors_do():
    """CMYK, LA, RGBA, L, P and P with a transparent index: transparency composited onto white."""
    p = noise(40, 30).convert("P")
    p_transparent = p.copy()
    p_transparent.info["transparency"] = 7
    cases = {"CMYK": encode(noise(40, 30, "CMYK"), "JPEG"), "LA": encode(noise(40, 30, "LA"), "PNG"),
             "RGBA": encode(noise(40, 30, "RGBA"), "PNG"), "L": encode(noise(40, 30, "L"), "PNG"),
             "P": encode(p, "PNG"), "P+transparency": encode(p_transparent, "PNG", transparency=7)}
    for name, data in cases.items():
        src = Image.open(io.BytesIO(data))
        assert probe_image(data).mode == name.split("+")[0], name
        expect = convert_to_rgb(src, return_numpy=True)
        assert np.array_equal(np.asarray(decode_image(data)), expect), name
    rgba = np.asarray(decode_image(cases["RGBA"]))
    assert not np.array_equal(rgba, np.asarray(Image.open(io.BytesIO(cases["RGBA"])).convert("RGB")))


def test_exif_orientation_is_not_applied_as_in_transformers():
    """A portrait photo stored landscape with orientation 6: ridge, like transformers' processors,
    sees the stored pixels (no exif_transpose)."""
    im = noise(64, 32)
    exif = Image.Exif()
    exif[0x0112] = 6
    data = encode(im, "JPEG", exif=exif, quality=95)
    out = decode_image(data)
    assert out.size == (64, 32)
    assert np.array_equal(np.asarray(out), convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True))


def test_animated_gif_and_webp_give_their_first_frame():
    red, blue = Image.new("RGB", (16, 16), (255, 0, 0)), Image.new("RGB", (16, 16), (0, 0, 255))
    gif = encode(red, "GIF", save_all=True, append_images=[blue, blue], duration=50, loop=0)
    webp = encode(red, "WEBP", save_all=True, append_images=[blue], duration=50, lossless=True)
    for data in (gif, webp):
        assert Image.open(io.BytesIO(data)).n_frames > 1
        assert (np.asarray(decode_image(data)) == (255, 0, 0)).all()


def test_a_decompression_bomb_is_refused_by_its_header():
    """A 66-byte PNG declaring 100,000 x 100,000 (Pillow's own bomb limit speaks first), and a real
    one: 64 MB of zeros in a 64 KB PNG, 8000 x 8000, under Pillow's limit but over ridge's."""
    refused(png_header_only(100_000, 100_000, zlib.compress(b"\0" * 64)), "more than the 50000000 pixels")
    rows = zlib.compress(b"\0" * (8001 * 8000), 9)
    bomb = png_header_only(8000, 8000, rows)
    assert len(bomb) < 100_000
    t = time.perf_counter()
    refused(bomb, "8000x8000 = 64000000 pixels: at most 50000000")
    with pytest.raises(InvalidRequest, match="at most 50000000"):
        probe_image(bomb)
    assert time.perf_counter() - t < 0.5  # refused from the header: nothing was inflated
    # between ridge's bound and Pillow's warning: Pillow's warning is an error too
    refused(png_header_only(10_000, 10_000), "more than the 50000000 pixels")


def test_sizes_out_of_bounds():
    refused(encode(noise(1, 1), "PNG"), "1x1: each side must be at least 4")
    refused(encode(noise(3, 300), "PNG"), "3x300: each side must be at least 4")
    refused(png_header_only(20_000, 20_000), "more than the 50000000 pixels")
    refused(png_header_only(20_000, 100), "20000x100: each side must be at most 16384")
    small = ImageLimits(max_side=64, max_pixels=2000, min_side=2)
    refused(png_header_only(65, 10), "each side must be at most 64", small)
    refused(png_header_only(50, 50), "50x50 = 2500 pixels: at most 2000", small)
    assert decode_image(encode(noise(2, 2), "PNG"), small).size == (2, 2)


def test_bytes_bound_is_checked_first():
    data = encode(noise(64, 64), "PNG")
    refused(data, f"image is {len(data)} bytes: at most 1000", ImageLimits(max_bytes=1000))
    refused(b"", "image is empty")


def test_truncated_files_are_refused_not_filled():
    jpeg = encode(noise(200, 120), "JPEG", quality=90)
    assert not ImageFile.LOAD_TRUNCATED_IMAGES
    cut = jpeg[: len(jpeg) // 2]
    assert probe_image(cut).width == 200  # the header is intact ...
    refused(cut, "truncated or corrupt")  # ... the pixels are not
    png = encode(noise(200, 120), "PNG")
    refused(png[: len(png) - 300], "truncated or corrupt")
    refused(png[:30], "header cannot be read|not an image")


def test_unknown_formats_and_random_bytes():
    refused(rng.integers(0, 256, 5000, dtype=np.uint8).tobytes(), r"not an image in an accepted format \(PNG")
    refused(encode(noise(32, 32), "TIFF"), "not an image in an accepted format")
    refused(encode(noise(32, 32), "ICO"), "not an image in an accepted format")
    refused(b"<svg xmlns='http://www.w3.org/2000/svg'/>", "not an image in an accepted format")


def test_the_truncated_images_switch_is_not_honoured(monkeypatch):
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(RuntimeError, match="LOAD_TRUNCATED_IMAGES"):
        decode_image(encode(noise(8, 8), "PNG"))


def test_data_urls():
    data = encode(noise(8, 8), "PNG")
    b64 = base64.b64encode(data).decode()
    assert parse_data_url(f"data:image/png;base64,{b64}") == data
    assert parse_image_url(f"DATA:image/jpeg;base64,{b64[:40]}\n{b64[40:]}") == data  # media type not trusted
    with pytest.raises(InvalidRequest, match="must be base64"):
        parse_data_url("data:image/png,rawbytes")
    with pytest.raises(InvalidRequest, match="'text/plain' is not an image"):
        parse_data_url(f"data:text/plain;base64,{b64}")
    with pytest.raises(InvalidRequest, match="base64 payload is malformed"):
        parse_data_url("data:image/png;base64,@@@@")
    with pytest.raises(InvalidRequest, match="form data:image"):
        parse_data_url("data:image/png;base64")
    with pytest.raises(InvalidRequest, match="at most 1000"):
        parse_data_url("data:image/png;base64," + "A" * 2000, ImageLimits(max_bytes=1000))


def test_remote_urls_are_refused_unless_the_operator_allows_fetching():
    for url in ("http://example.com/cat.png", "https://example.com/cat.png"):
        with pytest.raises(InvalidRequest, match="remote image URLs are refused: this daemon does not fetch"):
            parse_image_url(url)
        assert parse_image_url(url, allow_remote=True) == RemoteImage(url)
    for url in ("file:///etc/passwd", "ftp://x/y.png", "cat.png"):
        with pytest.raises(InvalidRequest, match="is not accepted: use a data: URL"):
            parse_image_url(url, allow_remote=True)


def test_the_package_is_torch_free():
    """The gateway imports ridge.vision: nothing in it may pull torch in."""
    code = "import sys, ridge.vision; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr
