"""``dayzero profile --image``: the vision tower's blocks and mergers timed as layers of kind "vision", before the
decoder layers, in the table, the JSON and the plot; a text-only model refuses images."""
from __future__ import annotations

import json

import pytest

from dayzero import cli
from dayzero.tools.profile import profile
from dayzero.tools.profile_report import figure, render
from tests.conftest import CONFIGS
from tests.multimodal.vl_checkpoints import make_checkpoint, noise_image

# the tiny towers have one block; Qwen3-VL's deep-stack merger reads it; Kimi-K2.5's projector is its merger
NAMES = {"qwen3_5_moe": ["v0", "merger"], "qwen3_vl_moe": ["v0", "ds0", "merger"], "kimi_k25": ["v0", "merger"]}



@pytest.fixture(scope="module", params=sorted(NAMES))
def vl_ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_checkpoint(path, request.param)
    return request.param, path


def merged_tokens(model_type: str, path, image_file) -> int:
    """The 128 x 64 image's merged tokens: Qwen's 32-pixel cells, 4 x 2; Kimi's processor resizes to its 28-pixel
    cells (its count is the processor's, compared with transformers' in tests/multimodal)."""
    if model_type != "kimi_k25":
        return 8
    from PIL import Image

    from dayzero.tools.align_images import processor_of, vision_config

    raw, family = vision_config(path)
    return int(processor_of(path, raw, family)([Image.open(image_file).convert("RGB")]).num_tokens[0])


@pytest.fixture(scope="module")
def image_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("images") / "wide.png"
    noise_image(128, 64, seed=1).save(f)
    return f


def test_vision_layers_are_timed_before_the_decoder_layers(vl_ckpt, image_file):
    model_type, path = vl_ckpt
    r = profile(str(path), prompt_len=12, steps=2, device="cpu", repeats=1, images=[image_file.read_bytes()])
    names = NAMES[model_type]
    vision, decoder = r["layers"][:len(names)], r["layers"][len(names):]
    assert [l["index"] for l in vision] == names and all(l["kind"] == "vision" for l in vision)
    assert all(l["prefill_s"] > 0 and l["decode_s"] == 0 and l["weights_bytes"] > 0 for l in vision)
    assert [l["index"] for l in decoder] == [0, 1, 2] and all(l["prefill_s"] > 0 for l in decoder)
    assert r["images"] == 1 and r["image_tokens"] == merged_tokens(model_type, path, image_file)
    assert r["prefill"]["vision_s"] == pytest.approx(sum(l["prefill_s"] for l in vision))
    kinds = {k["kind"]: k for k in r["by_kind"]}
    assert kinds["vision"]["layers"] == len(names) and kinds["vision"]["prefill_s"] > 0
    assert kinds["vision"]["parts"]["attention"]["prefill_s"] > 0  # the tower's vision_attention op
    text = render(r)
    assert f"+ 1 image ({r['image_tokens']} tokens)" in text and "the vision tower's" in text
    assert "  v0      vision" in text and "  merger  vision" in text
    labels = [t.get_text() for t in figure(r).axes[1].get_xticklabels()]
    assert labels == [f"{n} vision" for n in names] + [f"{i} {l['kind']}" for i, l in enumerate(decoder)]


def test_profile_cli_with_an_image(vl_ckpt, image_file, tmp_path, capsys):
    _, path = vl_ckpt
    png = tmp_path / "profile.png"
    rc = cli.main(["profile", str(path), "--prompt-len", "8", "--steps", "1", "--repeats", "1", "--device", "cpu",
                   "--image", str(image_file), "--plot", str(png), "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    r = json.loads(out.out)
    assert r["layers"][0]["index"] == "v0" and r["layers"][0]["prefill_s"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_text_only_model_refuses_images(image_file, capsys):
    rc = cli.main(["profile", str(CONFIGS / "dayzero-tiny.json"), "--device", "cpu", "--image", str(image_file)])
    err = capsys.readouterr().err
    assert rc == 2 and "text-only model" in err and "--image needs a vision-language checkpoint" in err
