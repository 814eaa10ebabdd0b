"""``dayzero align --image``: every vision layer (tower blocks, deep-stack mergers, the merger) and every decoder
layer over the prompt with its image tokens, against transformers' own vision-language model and our fp32
reference; a corrupted tower block fails from that block on; a text-only model refuses images."""
from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from dayzero import cli
from dayzero.tools.align import align
from dayzero.tools.align_images import with_images
from dayzero.tools.align_report import format_report, plot
from tests.hf.harness import make_hf_checkpoint
from tests.multimodal.vl_checkpoints import (IMAGE_TOKEN, INIT, PREPROCESSOR, VISION_END, VISION_START, config,
                                             noise_image, text_ids)

RTOL = 1e-4
SHORT = ["--lengths", "7,40", "--device", "cpu", "--dtype", "float32"]
# three tower blocks, Qwen3-VL's deep-stack merger after the middle one; Kimi-K2.5's projector as its merger
NAMES = {"qwen3_5_moe": ["v0", "v1", "v2", "merger"], "qwen3_vl_moe": ["v0", "v1", "ds0", "v2", "merger"],
         "kimi_k25": ["v0", "v1", "v2", "merger"]}
# one attention output projection of a tower block, by the checkpoint's names
BLOCK_PROJ = {"kimi_k25": "vision_tower.encoder.blocks.{}.wo.weight"}


def make(path, model_type: str):
    cfg = config(model_type)
    vision = {**cfg["vision_config"], "num_hidden_layers" if model_type == "kimi_k25" else "depth": 3}
    if model_type == "qwen3_vl_moe":
        vision["deepstack_visual_indexes"] = [1]
    make_hf_checkpoint(path, model_type, init=INIT.get(model_type), auto_class="AutoModelForImageTextToText",
                       **{**cfg, "vision_config": vision})
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return path


@pytest.fixture(scope="module", params=sorted(NAMES))
def vl_ckpt(request, tmp_path_factory):
    return request.param, make(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def image_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("images")
    files = [d / "wide.png", d / "tall.png"]
    noise_image(128, 64, seed=1).save(files[0])
    noise_image(64, 96, seed=2).save(files[1])
    return files


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(["align", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def images_args(files) -> list:
    return [a for f in files for a in ("--image", f)]


@pytest.mark.parametrize("reference", ["hf", "fp32"])
def test_every_vision_and_decoder_layer_matches(vl_ckpt, image_files, capsys, reference):
    model_type, path = vl_ckpt
    rc, out, err = run_cli(capsys, path, "--reference", reference, *SHORT, *images_args(image_files), "--json")
    assert rc == 0, err
    r = json.loads(out)
    assert r["passed"] and r["reference"] == reference
    assert [row["name"] for row in r["vision_rows"]] == NAMES[model_type]
    assert all(row["kind"] == "vision" for row in r["vision_rows"])
    assert all(row["rel_err"] < RTOL and row["passed"] for row in r["vision_rows"] + r["rows"]), r
    assert len(r["rows"]) == 3 and r["vision_first_failing"] is None and r["first_failing"] is None
    # each default prompt holds both images (Qwen: 8 + 6 merged tokens, each placeholder with its start and end
    # tokens; Kimi's 28-pixel cells give other counts)
    assert r["prompt_images"] == [2, 2]
    if model_type != "kimi_k25":
        assert r["prompt_lengths"] == [7 + 2 * 2 + 8 + 6, 40 + 2 * 2 + 8 + 6]
    assert r["top1"] == 1.0 and r["logits_rel_err"] < RTOL
    assert "vision" in r["by_kind"]


def test_report_lists_the_vision_layers_first(vl_ckpt, image_files, tmp_path):
    model_type, path = vl_ckpt
    r = align(path, reference="hf", dtype="float32", device="cpu", lengths=(9,),
              images=[f.read_bytes() for f in image_files])
    text = format_report(r)
    vision, decoder = text.index("vision layers"), text.index("decoder layers")
    assert vision < decoder and text.index("    v0  vision") < decoder < text.index("     0  ")
    assert "merger  vision" in text and "first vision layer over threshold: none" in text and text.endswith("PASS")
    png = tmp_path / "align.png"
    plot(r, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_image_twice_in_a_prompt_and_text_only_prompts(vl_ckpt, image_files):
    """Given prompts: the placeholders take the images in order (the engine encodes a repeated image once,
    transformers twice: compared image by image); a prompt without images has no vision rows to add."""
    model_type, path = vl_ckpt
    wide, tall = (f.read_bytes() for f in image_files)
    ph = [VISION_START, IMAGE_TOKEN, VISION_END]
    prompts = [text_ids(3, 1) + ph + text_ids(4, 2) + ph + ph + text_ids(5, 3), text_ids(11, 4)]
    r = align(path, reference="hf", dtype="float32", device="cpu", prompts=prompts, images=[wide, tall, wide])
    assert r.passed and r.prompt_images == [3, 0]
    assert all(row.rel_err < RTOL for row in r.vision_rows + r.rows)


def corrupt_block(src, dst, block: int, model_type: str, scale: float = 4.0):
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    name = BLOCK_PROJ.get(model_type, "model.visual.blocks.{}.attn.proj.weight").format(block)
    tensors[name] = tensors[name] * scale
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


def test_corrupted_vision_block_fails_from_there(vl_ckpt, image_files, tmp_path, capsys):
    model_type, path = vl_ckpt
    bad = tmp_path / "bad"
    corrupt_block(path, bad, block=1, model_type=model_type)
    rc, out, err = run_cli(capsys, bad, "--reference", "hf", "--reference-model", path, *SHORT,
                           *images_args(image_files), "--json")
    assert rc == 1, err
    r = json.loads(out)
    names = NAMES[model_type]
    assert not r["passed"] and r["vision_first_failing"] == names.index("v1")
    rows = r["vision_rows"]
    assert rows[0]["passed"] and rows[0]["rel_err"] < RTOL  # block 0 is before the corruption
    assert all(not row["passed"] and row["rel_err"] > r["threshold"] for row in rows[1:]), rows
    assert not r["rows"][0]["passed"]  # the image tokens carry the wrong features into the decoder


def test_text_only_model_refuses_images(tiny_ckpt, image_files, capsys):
    rc, out, err = run_cli(capsys, tiny_ckpt, "--device", "cpu", "--image", image_files[0])
    assert rc == 2 and out == ""
    assert "text-only model" in err and "--image needs a vision-language checkpoint" in err


def test_missing_image_file(vl_ckpt, tmp_path, capsys):
    _, path = vl_ckpt
    rc, _, err = run_cli(capsys, path, "--device", "cpu", "--image", tmp_path / "nope.png")
    assert rc == 2 and "no such file" in err


def test_placeholders_take_the_images_in_order():
    ph = [7, 9, 8]
    prompts = [[1, 9, 2], [3], [9, 4, 9]]
    assert with_images(prompts, ["a", "b", "c"], 9, ph) == [["a"], [], ["b", "c"]]
    with pytest.raises(ValueError, match="hold 3 image placeholder"):
        with_images([[1, 9, 2], [9, 9]], ["a", "b"], 9, ph)
    plain = [[1, 2], [3, 4, 5, 6]]
    assert with_images(plain, ["a", "b"], 9, ph, middle=True) == [["a", "b"], ["a", "b"]]
    assert plain == [[1] + ph * 2 + [2], [3, 4] + ph * 2 + [5, 6]]
