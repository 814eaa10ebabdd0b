"""Content parts as ``LLM.chat`` takes them (``dayzero.multimodal.content``, the server's parser too): inline
Pillow images and bytes beside data URLs, in order, rendered as template image parts; multi_modal_data of
prompt dicts."""
from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from dayzero.multimodal.content import MediaPolicy, image_list, load_chat
from dayzero.multimodal.image import ImageLimits


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_parts_become_template_images_in_order():
    a, b, c = Image.new("RGB", (8, 8), "red"), Image.new("RGB", (4, 6), "blue"), Image.new("RGB", (5, 3), "green")
    url = "data:image/png;base64," + base64.b64encode(png(a)).decode()
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "compare"},
                                             {"type": "image_url", "image_url": {"url": url}},
                                             {"type": "image", "image": b},
                                             {"type": "image", "image": png(c)}]}]
    rendered, images = load_chat(messages)
    assert rendered[0] == messages[0]
    assert rendered[1]["content"] == [{"type": "text", "text": "compare"}] + [{"type": "image"}] * 3
    assert [im.size for im in images] == [(8, 8), (4, 6), (5, 3)]
    assert images[1].getpixel((0, 0)) == (0, 0, 255)


@pytest.mark.parametrize("part, match", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "remote images is not enabled"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "not valid base64"),
    ({"type": "image", "image": b"not an image"}, "cannot"),
    ({"type": "audio"}, "not supported"),
])
def test_bad_parts(part, match):
    with pytest.raises(ValueError, match=match):
        load_chat([{"role": "user", "content": [part]}])


def test_inline_bytes_over_the_limit():
    data = png(Image.new("RGB", (64, 64)))
    policy = MediaPolicy(limits=ImageLimits(max_bytes=len(data) - 1))
    with pytest.raises(ValueError, match="over the limit"):
        load_chat([{"role": "user", "content": [{"type": "image", "image": data}]}], policy)


def test_multi_modal_data():
    img = Image.new("RGB", (2, 2))
    assert image_list(None) == [] and image_list({"image": img}) == [img] and image_list({"image": [img, img]}) == [img, img]
    with pytest.raises(ValueError, match="only 'image'"):
        image_list({"video": img})
