"""Images from untrusted bytes: decode with Pillow, refuse what should not be decoded, convert to RGB.

Every refusal is a ``ValueError`` whose message says what was wrong, so the server can answer 400:
no data, data over the byte limit, data Pillow cannot identify, a format outside PNG/JPEG/WebP/GIF, a
zero-size image, more pixels than the pixel limit (read from the header, before any pixel is decoded,
so a small file that claims a huge canvas costs nothing), and data that is truncated or corrupt.
"""
from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

from PIL import Image, ImageOps, UnidentifiedImageError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


@dataclass(frozen=True)
class ImageLimits:
    """Bounds on one input image: bytes of the encoded file and pixels (width * height) of its canvas."""

    max_bytes: int = 20 << 20
    max_pixels: int = 64 << 20


DEFAULT_LIMITS = ImageLimits()


def check_size(w: int, h: int, limits: ImageLimits) -> None:
    """A canvas of w x h pixels: not empty, and within the pixel limit."""
    if w <= 0 or h <= 0:
        raise ValueError(f"image has zero size ({w}x{h})")
    if w * h > limits.max_pixels:
        raise ValueError(f"image is {w}x{h} = {w * h} pixels, over the limit of {limits.max_pixels}")


def decode_image(data: bytes, limits: ImageLimits = DEFAULT_LIMITS) -> Image.Image:
    """Decode PNG/JPEG/WebP/GIF bytes into a loaded Pillow image (first frame of an animation, EXIF
    orientation applied, mode kept: :func:`to_rgb` converts)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"image data must be bytes, got {type(data).__name__}")
    if len(data) == 0:
        raise ValueError("image data is empty")
    if len(data) > limits.max_bytes:
        raise ValueError(f"image data is {len(data)} bytes, over the limit of {limits.max_bytes}")
    try:
        with warnings.catch_warnings():
            # Pillow warns (and past twice its own limit raises) on huge canvases; ours is checked below
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise ValueError(f"image is too large to decode: {e}") from None
    except UnidentifiedImageError:  # Pillow's message names its in-memory file object: say it plainly
        raise ValueError("image data cannot be decoded: not a PNG, JPEG, WebP or GIF image Pillow recognises") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise ValueError(f"image data cannot be decoded ({type(e).__name__}: {e})") from None
    if img.format not in FORMATS:
        raise ValueError(f"image format {img.format} is not supported (supported: {', '.join(FORMATS)})")
    check_size(*img.size, limits)
    try:
        img.seek(0)  # the first frame of an animated GIF / WebP
        img.load()  # decodes the pixels: truncated or corrupt data fails here
        img = ImageOps.exif_transpose(img)
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ValueError(f"image data is truncated or corrupt ({type(e).__name__}: {e})") from None
    return img


def to_rgb(img: Image.Image) -> Image.Image:
    """RGB, with any transparency (an alpha band, or a palette / tRNS transparent colour) composited on
    white, as the transformers image processors convert their inputs."""
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def load_image(image: Image.Image | bytes, limits: ImageLimits = DEFAULT_LIMITS) -> Image.Image:
    """An RGB Pillow image from encoded bytes (checked by :func:`decode_image`) or from a Pillow image
    (whose size is checked against the same limits)."""
    if isinstance(image, Image.Image):
        check_size(*image.size, limits)
    else:
        image = decode_image(image, limits)
    return to_rgb(image)
