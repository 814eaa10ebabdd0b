"""Chat messages with OpenAI content parts: text and images, checked against a media policy and loaded.

A message's content is a string or a list of parts: ``{"type": "text", "text": ...}`` and
``{"type": "image_url", "image_url": {"url": ...}}`` (also ``input_image`` and ``image`` parts with the URL as a
string; from Python, an ``image`` part may hold the Pillow image or encoded bytes itself). An image URL is a
``data:image/...;base64,...`` URL; a local file (``file:///...`` or a path) only inside
the policy's ``allowed_local_media_path``, after symlinks and ``..`` are resolved; an ``http(s)://`` URL only when
``allow_remote_media`` is set, fetched with a timeout and the byte limit.

Work goes from cheap to dear, so a bad request costs little: the parts are parsed and counted
(:func:`parse_messages`, :func:`check_count`), every URL is checked against the policy before anything is read
(:func:`resolve`), then the bytes are read and decoded (:func:`load_images`; pixel limit from the header, before
the pixels). Every refusal is a :class:`MediaError`: a ``ValueError`` naming the part, with a short reason for
metrics. Messages come back as chat templates take them: a message without images has string content, one with
images a list of ``{"type": "text", "text"}`` and ``{"type": "image"}`` parts in order.
"""
from __future__ import annotations

import base64
import binascii
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from dayzero.multimodal.image import DEFAULT_LIMITS, ImageLimits, load_image

IMAGE_PART_TYPES = ("image_url", "input_image", "image")
_DATA_URL = re.compile(r"data:([^,;]*)((?:;[^,;]*)*),", re.IGNORECASE)
_CHUNK = 64 << 10


@dataclass(frozen=True)
class MediaPolicy:
    """What a request's images may be and where they may come from."""

    max_images: int = 8  # per request
    limits: ImageLimits = DEFAULT_LIMITS  # per image
    allowed_local_media_path: str | None = None  # local files only under this directory; none when unset
    allow_remote_media: bool = False  # fetch http(s) URLs
    fetch_timeout: float = 10.0  # seconds for a whole remote fetch

    def __post_init__(self):
        if not isinstance(self.max_images, int) or isinstance(self.max_images, bool) or self.max_images < 0:
            raise ValueError(f"max_images must be an int >= 0, got {self.max_images!r}")
        for name, value in (("max_image_bytes", self.limits.max_bytes), ("max_image_pixels", self.limits.max_pixels)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.fetch_timeout, (int, float)) or not self.fetch_timeout > 0:
            raise ValueError(f"fetch_timeout must be a number of seconds > 0, got {self.fetch_timeout!r}")
        if self.allowed_local_media_path is not None and not Path(self.allowed_local_media_path).is_dir():
            raise ValueError(f"allowed_local_media_path {self.allowed_local_media_path!r} is not a directory")


class MediaError(ValueError):
    """A refused content part. ``param``: where it is (``messages[0].content[1]``); ``reason``: a short label."""

    def __init__(self, message: str, param: str | None = None, reason: str = "invalid"):
        super().__init__(message)
        self.param, self.reason = param, reason


@dataclass(frozen=True)
class ImageRef:
    url: str | None
    param: str  # where in the messages the part is
    inline: object = None  # an ``image`` part's own Pillow image or encoded bytes (Python callers: ``LLM.chat``)


@dataclass(frozen=True)
class Source:
    """A checked image URL: ``kind`` "data" (``value``: the base64 text), "file" (a resolved path), "remote", or
    "inline" (``inline``: the part's Pillow image or bytes)."""

    kind: str
    value: str
    param: str
    inline: object = None


# --- parts -------------------------------------------------------------------------------------------
def parse_content(content, where: str) -> tuple[str | list[dict], list[ImageRef]]:
    """One message's content as the template takes it, and its images in order."""
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise MediaError(f"{where} must be a string or a list of content parts, got {type(content).__name__}", where)
    parts, refs = [], []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise MediaError(f"{at}.text must be a string", f"{at}.text")
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image" and isinstance(part.get("image"), (Image.Image, bytes, bytearray)):
            refs.append(ImageRef(None, at, part["image"]))
            parts.append({"type": "image"})
        elif kind in IMAGE_PART_TYPES:
            refs.append(ImageRef(_image_url(part, at), at))
            parts.append({"type": "image"})
        elif isinstance(kind, str):
            raise MediaError(f"{at}: content part type {kind!r} is not supported; use 'text' or 'image_url'", at)
        else:
            raise MediaError(f"{at} must be an object with a 'type', e.g. {{'type': 'text', 'text': '...'}}", at)
    if not refs:  # text alone: one string, as text-only templates expect
        return "\n".join(p["text"] for p in parts), []
    return parts, refs


def _image_url(part: dict, at: str) -> str:
    # image_url: {"url": ...} (chat) or a string (responses' input_image); image: "image" or "url"
    value = next((part[k] for k in ("image_url", "image", "url") if part.get(k) is not None), None)
    if isinstance(value, dict):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise MediaError(f"{at}: an image part needs a URL, e.g. {{'type': 'image_url', 'image_url': {{'url': "
                         f"'data:image/png;base64,...'}}}}", at, "bad_url")
    return value


def parse_messages(messages: list[dict]) -> tuple[list[dict], list[ImageRef]]:
    """``[{"role", "content", ...}]`` (roles checked by the caller) with content as templates take it, and every
    image of every message in order."""
    out, refs = [], []
    for i, m in enumerate(messages):
        content, found = parse_content(m.get("content"), f"messages[{i}].content")
        out.append({**m, "content": content})
        refs += found
    return out, refs


def text_chars(messages: list[dict]) -> int:
    """Characters of text in messages returned by :func:`parse_messages`."""
    return sum(len(c) if isinstance(c, str) else sum(len(p.get("text", "")) for p in c)
               for c in (m["content"] for m in messages))


def check_count(refs: list[ImageRef], policy: MediaPolicy) -> None:
    if len(refs) > policy.max_images:
        raise MediaError(f"the messages hold {len(refs)} images, the limit is {policy.max_images} per request",
                         refs[policy.max_images].param, "too_many_images")


# --- sources -----------------------------------------------------------------------------------------
def resolve(ref: ImageRef, policy: MediaPolicy) -> Source:
    """The policy's verdict on one URL, before anything is read or fetched."""
    url, at = ref.url, ref.param
    if ref.inline is not None:
        if isinstance(ref.inline, (bytes, bytearray)) and len(ref.inline) > policy.limits.max_bytes:
            raise MediaError(f"{at}: image data is {len(ref.inline)} bytes, over the limit of "
                             f"{policy.limits.max_bytes}", at, "too_large")
        return Source("inline", "", at, ref.inline)
    if url[:5].lower() == "data:":
        return Source("data", _data_payload(url, at, policy.limits), at)
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme in ("http", "https"):
        if not policy.allow_remote_media:
            raise MediaError(f"{at}: fetching remote images is not enabled on this server (allow_remote_media); "
                             f"send the image as a data:image/...;base64 URL", at, "remote_not_allowed")
        return Source("remote", url, at)
    if scheme == "file":
        parsed = urllib.parse.urlsplit(url)
        if parsed.netloc not in ("", "localhost"):
            raise MediaError(f"{at}: file URL names host {parsed.netloc!r}; only local files can be read", at,
                             "scheme_not_allowed")
        return Source("file", _local_path(urllib.parse.unquote(parsed.path), at, policy), at)
    if scheme and len(scheme) > 1:  # a one-letter "scheme" is a Windows drive, i.e. a path
        raise MediaError(f"{at}: image URL scheme {scheme!r} is not supported; use data:, file: or http(s):", at,
                         "scheme_not_allowed")
    return Source("file", _local_path(url, at, policy), at)


def _data_payload(url: str, at: str, limits: ImageLimits) -> str:
    m = _DATA_URL.match(url)
    if m is None:
        raise MediaError(f"{at}: a data URL must look like data:image/png;base64,<data>", at, "bad_url")
    media, params = m.group(1).strip().lower(), m.group(2).lower().split(";")
    if media and not media.startswith("image/"):
        raise MediaError(f"{at}: data URL media type {media!r} is not an image", at, "unsupported_format")
    if "base64" not in params:
        raise MediaError(f"{at}: image data URLs must be base64 (data:image/png;base64,<data>)", at, "not_base64")
    payload = url[m.end():]
    # every 4 characters of base64 are 3 bytes: a payload too long is refused before it is decoded
    if (len(payload) // 4) * 3 > limits.max_bytes + 3:
        raise MediaError(f"{at}: image data is about {len(payload) // 4 * 3} bytes, over the limit of "
                         f"{limits.max_bytes}", at, "too_large")
    return payload


def _local_path(path: str, at: str, policy: MediaPolicy) -> str:
    root = policy.allowed_local_media_path
    if root is None:
        raise MediaError(f"{at}: reading local image files is not enabled on this server (allowed_local_media_path)",
                         at, "local_not_allowed")
    base = Path(root).resolve()
    try:
        target = (base / path).resolve()  # symlinks and .. resolved first; an absolute path replaces base
    except (OSError, RuntimeError, ValueError) as e:  # a symlink loop, a NUL byte
        raise MediaError(f"{at}: image path {path!r} cannot be resolved ({e})", at, "bad_url") from None
    if not target.is_relative_to(base):
        raise MediaError(f"{at}: image path {path!r} is outside the allowed directory", at, "path_not_allowed")
    if not target.exists():
        raise MediaError(f"{at}: image file {path!r} does not exist", at, "missing_file")
    if not target.is_file():
        raise MediaError(f"{at}: image path {path!r} is not a regular file", at, "missing_file")
    return str(target)


# --- bytes and images --------------------------------------------------------------------------------
def read_source(src: Source, policy: MediaPolicy):
    """The image's encoded bytes (an inline Pillow image as it is)."""
    limit = policy.limits.max_bytes
    if src.kind == "inline":
        return src.inline
    if src.kind == "data":
        try:
            return base64.b64decode("".join(src.value.split()), validate=True)
        except (binascii.Error, ValueError) as e:
            raise MediaError(f"{src.param}: image data is not valid base64 ({e})", src.param, "not_base64") from None
    if src.kind == "file":
        return _read_file(src, limit)
    return _fetch(src, limit, policy.fetch_timeout)


def _too_large(src: Source, size: int | str, limit: int) -> MediaError:
    return MediaError(f"{src.param}: image data is {size} bytes, over the limit of {limit}", src.param, "too_large")


def _read_file(src: Source, limit: int) -> bytes:
    try:
        with open(src.value, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise _too_large(src, size, limit)
            data = f.read(limit + 1)
    except OSError as e:
        raise MediaError(f"{src.param}: image file cannot be read ({e.strerror})", src.param, "missing_file") from None
    if len(data) > limit:
        raise _too_large(src, f"more than {limit}", limit)
    return data


class _HTTPRedirects(urllib.request.HTTPRedirectHandler):
    max_redirections = 3

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urllib.parse.urlsplit(newurl).scheme.lower() not in ("http", "https"):
            raise urllib.error.HTTPError(newurl, code, "redirect to a non-HTTP URL refused", headers, fp)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_OPENER = urllib.request.build_opener(_HTTPRedirects)


def _fetch(src: Source, limit: int, timeout: float) -> bytes:
    deadline = time.monotonic() + timeout
    request = urllib.request.Request(src.value, headers={"User-Agent": "dayzero", "Accept": "image/*"})
    try:
        with _OPENER.open(request, timeout=timeout) as r:
            declared = r.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise _too_large(src, int(declared), limit)
            chunks, size = [], 0
            while chunk := r.read(_CHUNK):
                size += len(chunk)
                if size > limit:
                    raise _too_large(src, f"more than {limit}", limit)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not done after {timeout}s")
                chunks.append(chunk)
    except MediaError:
        raise
    except urllib.error.HTTPError as e:
        raise MediaError(f"{src.param}: image could not be fetched: HTTP {e.code} {e.reason}", src.param,
                         "fetch_failed") from None
    except (urllib.error.URLError, OSError, ValueError) as e:  # unreachable, refused, timed out, bad URL
        why = e.reason if isinstance(e, urllib.error.URLError) else e
        raise MediaError(f"{src.param}: image could not be fetched ({why})", src.param, "fetch_failed") from None
    return b"".join(chunks)


def decode(data, param: str, limits: ImageLimits) -> Image.Image:
    """An RGB image, or the refusal of :func:`dayzero.multimodal.image.decode_image` as a :class:`MediaError`."""
    try:
        return load_image(data, limits)
    except ValueError as e:
        msg = str(e)
        reason = ("too_large" if "over the limit" in msg or "too large" in msg
                  else "unsupported_format" if "not supported" in msg else "undecodable")
        raise MediaError(f"{param}: {msg}", param, reason) from None


def load_images(refs: list[ImageRef], policy: MediaPolicy) -> list[Image.Image]:
    """Every image, in order: all URLs checked against the policy before the first is read."""
    check_count(refs, policy)
    sources = [resolve(r, policy) for r in refs]
    return [decode(read_source(s, policy), s.param, policy.limits) for s in sources]


def image_list(data) -> list:
    """``multi_modal_data`` of a prompt dict (``{"image": image or [images]}``) -> its images."""
    if not data:
        return []
    if not isinstance(data, dict) or set(data) - {"image"}:
        raise ValueError(f"multi_modal_data takes only 'image', got {sorted(data) if isinstance(data, dict) else data!r}")
    images = data.get("image")
    if images is None:
        return []
    return list(images) if isinstance(images, (list, tuple)) else [images]


def load_chat(messages: list[dict], policy: MediaPolicy = MediaPolicy()) -> tuple[list[dict], list[Image.Image]]:
    """Messages as the chat template takes them, and their images decoded, in message order."""
    out, refs = parse_messages(messages)
    return out, load_images(refs, policy)
