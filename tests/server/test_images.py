"""Image content parts in chat messages: :mod:`dayzero.multimodal.content` on its own; images sent to a running
server of the bundled text-only model, refused unread; every bad image of RELIABILITY.md against a server of a tiny
random vision-language model with tight limits (each a 400 naming what was wrong, and the server serves the next
request); then chats with an image through that model."""
from __future__ import annotations

import base64
import http.server
import io
import json
import threading
from pathlib import Path

import openai
import pytest
from PIL import Image

from dayzero.multimodal.content import ImageRef, MediaError, MediaPolicy, load_chat, load_images, parse_messages
from dayzero.multimodal.image import ImageLimits
from tests.server.conftest import MODEL, ServerProcess, complete_ok


def encoded(size=(8, 6), fmt="PNG", seed=0) -> bytes:
    g = __import__("random").Random(seed)
    img = Image.new("RGB", size)
    img.putdata([(g.randrange(256), g.randrange(256), g.randrange(256)) for _ in range(size[0] * size[1])])
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


def plain(size) -> bytes:
    """A one-colour PNG: many pixels in few bytes."""
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 30, 90)).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def user(*urls: str, text: str = "what is this?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}]
             + [{"type": "image_url", "image_url": {"url": u}} for u in urls]}]


def refused(messages, policy: MediaPolicy) -> MediaError:
    with pytest.raises(MediaError) as e:
        load_chat(messages, policy)
    return e.value


@pytest.fixture
def media_dir(tmp_path) -> Path:
    """An allowed directory with one image and a symlink out of it; a secret image beside it, outside."""
    allowed = tmp_path / "allowed"
    (allowed / "sub").mkdir(parents=True)
    (allowed / "cat.png").write_bytes(encoded())
    (tmp_path / "secret.png").write_bytes(encoded(seed=1))
    (allowed / "escape.png").symlink_to(tmp_path / "secret.png")
    (allowed / "inside.png").symlink_to(allowed / "cat.png")
    return allowed


# --- content.py ----------------------------------------------------------------------------------------
def test_messages_as_templates_take_them():
    png = encoded()
    messages = user(data_url(png), data_url(encoded(seed=2)), text="two") + [
        {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(png)}]}]
    out, images = load_chat(messages)
    assert out[0] == {"role": "user", "content": [{"type": "text", "text": "two"}, {"type": "image"}, {"type": "image"}]}
    assert out[1]["content"] == "a\nb"  # text alone stays a string, for text-only templates
    assert out[2]["content"] == [{"type": "image"}]
    assert [im.size for im in images] == [(8, 6)] * 3 and all(im.mode == "RGB" for im in images)
    assert images[0].tobytes() == Image.open(io.BytesIO(png)).convert("RGB").tobytes()
    assert images[0].tobytes() != images[1].tobytes()  # in message order


@pytest.mark.parametrize("url, reason, fragment", [
    ("data:image/png;base64,@@@not base64@@@", "not_base64", "not valid base64"),
    ("data:image/png,rawbytes", "not_base64", "must be base64"),
    ("data:text/plain;base64,aGVsbG8=", "unsupported_format", "not an image"),
    ("data:image/png;base64," + base64.b64encode(b"not an image at all").decode(), "undecodable", "cannot be decoded"),
    ("data:image/png;base64," + base64.b64encode(encoded((30, 30))[:200]).decode(), "undecodable", "truncated"),
    (data_url(encoded(fmt="BMP"), "image/bmp"), "unsupported_format", "format BMP is not supported"),
    (data_url(encoded((40, 30))), "too_large", "1200 pixels, over the limit of 1000"),
    ("ftp://example.com/cat.png", "scheme_not_allowed", "scheme 'ftp' is not supported"),
    ("https://example.com/cat.png", "remote_not_allowed", "fetching remote images is not enabled"),
    ("file:///etc/passwd", "local_not_allowed", "reading local image files is not enabled"),
    ("cat.png", "local_not_allowed", "not enabled"),
])
def test_refusals(url, reason, fragment):
    e = refused(user(url), MediaPolicy(limits=ImageLimits(max_pixels=1000)))
    assert e.reason == reason and fragment in str(e), str(e)
    assert e.param == "messages[0].content[1]"


def test_byte_limit_before_decoding():
    png = encoded((16, 16))
    policy = MediaPolicy(limits=ImageLimits(max_bytes=len(png) - 1))
    assert "over the limit" in str(refused(user(data_url(png)), policy))
    huge = "data:image/png;base64," + "@" * 4000  # not even base64: refused by its length, unread
    e = refused(user(huge), MediaPolicy(limits=ImageLimits(max_bytes=1000)))
    assert e.reason == "too_large"


def test_count_before_any_image_is_read():
    bad = "data:image/png;base64,@@@"
    e = refused(user(bad, bad, bad), MediaPolicy(max_images=2))
    assert e.reason == "too_many_images" and "3 images, the limit is 2" in str(e) and e.param == "messages[0].content[3]"
    # every URL is checked against the policy before the first is read: the remote one is found, not the bad data
    assert refused(user(bad, "https://example.com/x.png"), MediaPolicy()).reason == "remote_not_allowed"


def test_part_shapes():
    with pytest.raises(MediaError, match="needs a URL"):
        parse_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(MediaError, match="'video_url' is not supported"):
        parse_messages([{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}])


def test_local_files(media_dir):
    policy = MediaPolicy(allowed_local_media_path=str(media_dir))
    cat = media_dir / "cat.png"
    for url in (str(cat), f"file://{cat}", "cat.png", "sub/../cat.png", "inside.png"):
        (image,) = load_images([ImageRef(url, "x")], policy)
        assert image.size == (8, 6), url
    for url, reason in [
        (str(media_dir.parent / "secret.png"), "path_not_allowed"),
        (f"file://{media_dir}/../secret.png", "path_not_allowed"),
        ("../secret.png", "path_not_allowed"),
        ("escape.png", "path_not_allowed"),  # a symlink out of the directory
        ("/etc/passwd", "path_not_allowed"),
        ("missing.png", "missing_file"),
        ("sub", "missing_file"),
        ("file://otherhost/cat.png", "scheme_not_allowed"),
    ]:
        with pytest.raises(MediaError) as e:
            load_images([ImageRef(url, "x")], policy)
        assert e.value.reason == reason, (url, str(e.value))


def test_local_directory_must_exist(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        MediaPolicy(allowed_local_media_path=str(tmp_path / "nope"))


@pytest.fixture
def http_images():
    """A loopback HTTP server: /cat.png, /big.png (over a 1000-byte limit), anything else 404."""
    files = {"/cat.png": encoded(), "/big.png": encoded((64, 64))}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = files.get(self.path)
            self.send_response(200 if body else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_remote_fetch(http_images):
    policy = MediaPolicy(allow_remote_media=True, limits=ImageLimits(max_bytes=1000), fetch_timeout=5.0)
    (image,) = load_images([ImageRef(http_images + "/cat.png", "x")], policy)
    assert image.size == (8, 6)
    for path, reason, fragment in [("/big.png", "too_large", "over the limit of 1000"),
                                   ("/nope.png", "fetch_failed", "HTTP 404")]:
        with pytest.raises(MediaError) as e:
            load_images([ImageRef(http_images + path, "x")], policy)
        assert e.value.reason == reason and fragment in str(e.value)


# --- servers: the bundled text-only model, and a tiny vision-language model with tight limits --------------
LIMITS = ("--limit-mm-per-prompt", "2", "--max-image-pixels", "4096", "--max-image-bytes", "8192")


@pytest.fixture(scope="module")
def media_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("media")
    allowed = root / "allowed"
    allowed.mkdir()
    (allowed / "cat.png").write_bytes(encoded())
    (root / "secret.png").write_bytes(encoded(seed=1))
    (allowed / "escape.png").symlink_to(root / "secret.png")
    return allowed


@pytest.fixture(scope="module")
def text_server(tmp_path_factory, media_root):
    srv = ServerProcess(tmp_path_factory.mktemp("serve-images"), "--num-cache-blocks", "256", "--max-model-len", "512",
                        "--allowed-local-media-path", str(media_root), *LIMITS)
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def strict_vl_server(tmp_path_factory, vl_checkpoint, media_root):
    """The tiny vision-language model with the limits and the allowed directory: bad images reach the checks."""
    srv = ServerProcess(tmp_path_factory.mktemp("serve-vl-strict"), str(vl_checkpoint), "--dtype", "float32",
                        "--num-cache-blocks", "256", "--max-model-len", "512",
                        "--allowed-local-media-path", str(media_root), *LIMITS)
    yield srv
    assert srv.stop() == 0, srv.log()


def _text_only_cases():
    """Images sent to a model without a vision encoder: refused unread, whatever they hold (a URL never fetched,
    a file never opened, data never decoded)."""
    return {
        "good-image": user(data_url(encoded())),
        "local-file": user("cat.png"),
        "undecodable": user(data_url(b"\x89PNG\r\n\x1a\n garbage")),
        "remote": user("https://example.com/cat.png"),
        "outside-allowed-dir": user("file:///etc/hostname"),
    }


@pytest.mark.parametrize("case", sorted(_text_only_cases()))
def test_text_only_model_refuses_images_unread(text_server, case):
    client = text_server.client()
    key = "dayzero_images_rejected_total{reason=no_vision_encoder}"
    before = text_server.metrics().get(key, 0)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=_text_only_cases()[case], max_tokens=2, stream=stream)
        assert e.value.status_code == 400 and "no vision encoder" in e.value.message, e.value.message
        assert e.value.body["param"].startswith("messages[0].content[")
    assert text_server.metrics()[key] == before + 2
    complete_ok(text_server)


def _bad_server_cases():
    good = data_url(encoded())
    return {
        "not-base64": (user("data:image/png;base64,@@@not base64@@@"), "not valid base64", "not_base64"),
        "undecodable": (user(data_url(b"\x89PNG\r\n\x1a\n garbage")), "cannot be decoded", "undecodable"),
        "truncated": (user(data_url(encoded((32, 32))[:300])), "truncated or corrupt", "undecodable"),
        "unsupported-format": (user(data_url(encoded(fmt="BMP"), "image/bmp")), "format BMP is not supported",
                               "unsupported_format"),
        "over-pixel-limit": (user(data_url(plain((80, 60)))), "4800 pixels, over the limit of 4096", "too_large"),
        "over-byte-limit": (user(data_url(encoded((60, 60), seed=3))), "over the limit of 8192", "too_large"),
        "too-many-images": (user(good, good, good), "3 images, the limit is 2", "too_many_images"),
        "scheme": (user("gopher://example.com/cat.png"), "scheme 'gopher' is not supported", "scheme_not_allowed"),
        "remote-off": (user("https://example.com/cat.png"), "fetching remote images is not enabled",
                       "remote_not_allowed"),
        "outside-allowed-dir": (user("file:///etc/hostname"), "outside the allowed directory", "path_not_allowed"),
        "dot-dot": (user("../secret.png"), "outside the allowed directory", "path_not_allowed"),
        "symlink-escape": (user("escape.png"), "outside the allowed directory", "path_not_allowed"),
        "missing-file": (user("nope.png"), "does not exist", "missing_file"),
    }


@pytest.mark.parametrize("case", sorted(_bad_server_cases()))
def test_bad_images_refused(strict_vl_server, case):
    messages, fragment, reason = _bad_server_cases()[case]
    client = strict_vl_server.client()
    name = client.models.list().data[0].id
    key = f"dayzero_images_rejected_total{{reason={reason}}}"
    before = strict_vl_server.metrics().get(key, 0)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=name, messages=messages, max_tokens=2, stream=stream)
        assert e.value.status_code == 400
        assert fragment in e.value.message, e.value.message
        assert e.value.body["param"].startswith("messages[0].content[")
    assert strict_vl_server.metrics()[key] == before + 2
    # nothing else affected: a text chat and a good image still answer
    reply = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert reply.choices[0].message.content is not None
    ok = client.chat.completions.create(model=name, messages=user(data_url(encoded())), max_tokens=2)
    assert ok.usage.completion_tokens >= 1
    strict_vl_server.wait_idle()


def test_images_counted(text_server):
    before = text_server.metrics().get("dayzero_images_received_total", 0)
    with pytest.raises(openai.BadRequestError):
        text_server.client().chat.completions.create(model=MODEL, messages=user("a.png", "b.png"), max_tokens=2)
    assert text_server.metrics()["dayzero_images_received_total"] == before + 2


def test_text_parts_still_work(text_server):
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}]
    reply = text_server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                                         extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 3 and reply.usage.prompt_tokens > 0


# --- a tiny vision-language model, end to end (runs last) ----------------------------------------------
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
VL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' or 'image' in c or 'image_url' in c %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in c %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN35 = dict(
    vision_config=dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64),
    text_config=dict(
        vocab_size=300, hidden_size=64, num_attention_heads=4, initializer_range=0.08, max_position_embeddings=512,
        pad_token_id=0, bos_token_id=1, eos_token_id=256, num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"], moe_intermediate_size=24,
        shared_expert_intermediate_size=40, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True}),
    # the byte-level tokenizer's specials: <|im_end|> 256, <|im_start|> 257, then SPECIAL's vision tokens in order
    image_token_id=259, video_token_id=261, vision_start_token_id=258, vision_end_token_id=260,
)


def _byte_tokenizer(path: Path) -> None:
    """256 byte tokens (no merges), the chat specials at 256.., and a Qwen-style template with image parts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(models.BPE(vocab=dict(sorted(vocab.items(), key=lambda kv: kv[1])), merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|im_end|>")
    fast.add_special_tokens({"additional_special_tokens": SPECIAL})
    assert fast.convert_tokens_to_ids("<|image_pad|>") == QWEN35["image_token_id"]
    fast.chat_template = VL_TEMPLATE
    fast.save_pretrained(str(path))


@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory):
    from tests.hf.harness import make_hf_checkpoint

    path = tmp_path_factory.mktemp("qwen3_5_moe")
    make_hf_checkpoint(path, "qwen3_5_moe", auto_class="AutoModelForImageTextToText", **QWEN35)
    _byte_tokenizer(path)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
        "min_pixels": 32 * 32, "max_pixels": 64 * 64, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
    return path


@pytest.fixture(scope="module")
def vl_server(tmp_path_factory, vl_checkpoint):
    srv = ServerProcess(tmp_path_factory.mktemp("serve-vl"), str(vl_checkpoint), "--dtype", "float32",
                        "--num-cache-blocks", "256", "--max-model-len", "512")
    yield srv
    assert srv.stop() == 0, srv.log()


def test_vision_model_chat_with_image(vl_server):
    """Depends on the engine taking images (``add_request(..., images=...)``)."""
    client = vl_server.client()
    name = client.models.list().data[0].id
    messages = user(data_url(encoded((64, 48))), text="describe")
    reply = client.chat.completions.create(model=name, messages=messages, max_tokens=4, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 4
    text_only = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "describe"}],
                                               max_tokens=1)
    # the template's three image tokens at least; more where the engine counts the patches the placeholder stands for
    assert reply.usage.prompt_tokens >= text_only.usage.prompt_tokens + 3
    chunks = list(client.chat.completions.create(model=name, messages=messages, max_tokens=4, stream=True, temperature=0,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 4
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    vl_server.wait_idle()


def test_the_same_image_in_two_concurrent_requests_is_encoded_once(vl_server):
    """Two chats with one picture at the same time, their texts (before the picture) different so that the prefix
    cache cannot serve the second: /metrics counts one encoder run and one cache hit, and both requests answer."""
    import concurrent.futures

    client, before = vl_server.client(), vl_server.metrics()
    name = client.models.list().data[0].id
    url = data_url(encoded((48, 64)))

    def ask(text):
        return client.chat.completions.create(model=name, messages=user(url, text=text), max_tokens=3, temperature=0,
                                              extra_body={"ignore_eos": True})

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(ask, ["first look", "second look"]))
    assert [r.usage.completion_tokens for r in replies] == [3, 3]
    after = vl_server.metrics()
    runs = after["dayzero_encoder_runs_total"] - before.get("dayzero_encoder_runs_total", 0)
    hits = after["dayzero_encoder_cache_hits_total"] - before.get("dayzero_encoder_cache_hits_total", 0)
    assert (runs, hits) == (1, 1), (runs, hits)
    vl_server.wait_idle()
