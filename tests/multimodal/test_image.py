"""Decoding untrusted image bytes: every refusal is a ValueError saying why; what decodes is RGB."""
from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from dayzero.multimodal import ImageLimits, decode_image, load_image, to_rgb


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def noise(w: int, h: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    bands = len(mode) if mode != "L" else 1
    a = np.random.default_rng(seed).integers(0, 256, (h, w, bands), dtype=np.uint8)
    return Image.fromarray(a.squeeze(-1) if bands == 1 else a, mode)


def png_header_only(width: int, height: int) -> bytes:
    """A PNG signature and a valid IHDR claiming width x height, with no pixel data at all."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", len(ihdr)) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    iend = struct.pack(">I", 0) + b"IEND" + struct.pack(">I", zlib.crc32(b"IEND"))
    return b"\x89PNG\r\n\x1a\n" + chunk + iend


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_supported_formats_decode(fmt):
    img = noise(23, 17)
    out = load_image(encode(img, fmt))
    assert out.mode == "RGB" and out.size == (23, 17)
    if fmt == "PNG":  # lossless: the same pixels
        assert np.array_equal(np.asarray(out), np.asarray(img))


def test_gif_first_frame():
    red, blue = Image.new("RGB", (8, 6), (255, 0, 0)), Image.new("RGB", (8, 6), (0, 0, 255))
    data = encode(red, "GIF", save_all=True, append_images=[blue], duration=50, loop=0)
    px = np.asarray(load_image(data))
    assert (px[..., 0] > 200).all() and (px[..., 2] < 50).all()


def test_alpha_composited_on_white():
    a = np.zeros((4, 5, 4), dtype=np.uint8)
    a[..., :3] = (10, 20, 30)
    a[0, 0, 3] = 255  # one opaque pixel, the rest transparent
    a[1, 1, 3] = 128
    out = np.asarray(load_image(encode(Image.fromarray(a, "RGBA"), "PNG"))).astype(int)
    assert tuple(out[0, 0]) == (10, 20, 30)
    assert tuple(out[2, 2]) == (255, 255, 255)
    assert np.abs(out[1, 1] - (np.array([10, 20, 30]) * 128 + 255 * 127) / 255).max() <= 1


def test_rgb_conversion_is_transformers():
    image_transforms = pytest.importorskip("transformers.image_transforms")
    pal = noise(9, 7).convert("P")
    pal.info["transparency"] = 3  # a palette image with a transparent index
    for img in (noise(9, 7, "RGBA"), noise(9, 7, "LA"), noise(9, 7, "L"), pal, noise(9, 7, "CMYK")):
        theirs = image_transforms.convert_to_rgb(img, return_numpy=True)
        assert np.array_equal(np.asarray(to_rgb(img)), theirs), img.mode


def test_empty_data():
    with pytest.raises(ValueError, match="empty"):
        decode_image(b"")


def test_not_bytes():
    with pytest.raises(ValueError, match="must be bytes"):
        decode_image("a path or a url")  # type: ignore[arg-type]


def test_over_the_byte_limit():
    data = encode(noise(40, 40), "PNG")
    with pytest.raises(ValueError, match="bytes, over the limit"):
        decode_image(data, ImageLimits(max_bytes=len(data) - 1))
    decode_image(data, ImageLimits(max_bytes=len(data)))


def test_garbage_is_undecodable():
    with pytest.raises(ValueError, match="cannot be decoded"):
        decode_image(b"this is not an image, only text" * 10)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_truncated_data(fmt):
    data = encode(noise(64, 48), fmt)
    with pytest.raises(ValueError, match="truncated or corrupt|cannot be decoded"):
        decode_image(data[: len(data) // 2])


def test_unsupported_format():
    for fmt in ("BMP", "TIFF"):
        with pytest.raises(ValueError, match=f"format {fmt} is not supported"):
            decode_image(encode(noise(8, 8), fmt))


def test_zero_size():
    with pytest.raises(ValueError, match="zero size|cannot be decoded"):
        decode_image(png_header_only(0, 10))
    with pytest.raises(ValueError, match="zero size"):
        load_image(Image.new("RGB", (0, 5)))


def test_pixel_limit_checked_before_decoding():
    # 60-byte files that claim huge canvases: refused from their headers, before any decoding (past
    # twice its own limit Pillow refuses at open; below that our limit does)
    with pytest.raises(ValueError, match="100000000 pixels, over the limit"):
        decode_image(png_header_only(10_000, 10_000))
    with pytest.raises(ValueError, match="too large to decode"):
        decode_image(png_header_only(50_000, 50_000))
    data = encode(noise(30, 20), "PNG")
    with pytest.raises(ValueError, match="600 pixels, over the limit of 599"):
        decode_image(data, ImageLimits(max_pixels=599))
    with pytest.raises(ValueError, match="over the limit"):
        load_image(noise(30, 20), ImageLimits(max_pixels=599))
    assert decode_image(data, ImageLimits(max_pixels=600)).size == (30, 20)


def test_exif_orientation_applied():
    img = noise(12, 8)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    assert decode_image(encode(img, "JPEG", exif=exif.tobytes())).size == (8, 12)
