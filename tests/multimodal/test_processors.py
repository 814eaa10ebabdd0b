"""The image processors against transformers' on the same Pillow images: pixel rows within 1e-6, equal
grids and placeholder counts; sizes odd and even, RGBA, tiny (upscaled) and large (downscaled)."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from dayzero.multimodal import KimiK25ImageProcessor, Qwen3VLImageProcessor, navit_resize, smart_resize

ATOL = 1e-6

# transformers' defaults, and what Qwen3-VL / Qwen3.5 checkpoints ship (with a smaller pixel budget, so
# the large image is downscaled and the test stays fast)
QWEN_CONFIGS = {
    "defaults": {},
    "qwen3-vl": {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                 "image_std": [0.5, 0.5, 0.5], "size": {"shortest_edge": 4096, "longest_edge": 160_000}},
}
KIMI_CONFIGS = {"defaults": {}, "small-budget": {"max_patches": 400, "size": {"max_height": 40, "max_width": 40}}}


def noise(w: int, h: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    a = np.random.default_rng(seed).integers(0, 256, (h, w, len(mode)), dtype=np.uint8)
    return Image.fromarray(a, mode)


IMAGES = {
    "odd-37x91": noise(37, 91, seed=1),
    "square-64": noise(64, 64, seed=2),
    "rgba-45x33": noise(45, 33, "RGBA", seed=3),
    "tiny-5x7": noise(5, 7, seed=4),  # below min_pixels: upscaled (Qwen); padded (Kimi)
    "large-1500x900": noise(1500, 900, seed=5),  # over the budget: downscaled
    "wide-700x60": noise(700, 60, seed=6),
}


def qwen_reference(cfg):
    mod = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl",
                              reason="transformers has no Qwen2-VL PIL image processor")
    return mod.Qwen2VLImageProcessorPil(**cfg)


def kimi_reference(cfg):
    import importlib.util

    import transformers

    if importlib.util.find_spec("transformers.models.kimi_k25") is None:
        pytest.skip(f"transformers {transformers.__version__} has no kimi_k25 image processor")
    if importlib.util.find_spec("torchvision") is None:
        pytest.skip("transformers' kimi_k25 image processor runs on torchvision, which is not installed")
    from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor

    return Kimi_K25ImageProcessor(**cfg)


def compare(ref, ours, images):
    theirs = ref(images, return_tensors="pt")
    got = ours(images)
    assert got.pixel_values.shape == theirs.pixel_values.shape
    assert (got.pixel_values - theirs.pixel_values.float()).abs().max().item() <= ATOL
    assert got.grid_thw.tolist() == theirs.image_grid_thw.tolist()
    merge = ours.merge_size**2
    expected = [ref.get_number_of_image_patches(im.height, im.width) // merge for im in images]
    assert got.num_tokens == expected == [ours.num_tokens(im.height, im.width) for im in images]
    assert got.num_tokens == [int(g.prod()) // merge for g in theirs.image_grid_thw]


@pytest.mark.parametrize("name", IMAGES)
@pytest.mark.parametrize("cfg", QWEN_CONFIGS, ids=str)
def test_qwen_matches_transformers(cfg, name):
    compare(qwen_reference(QWEN_CONFIGS[cfg]), Qwen3VLImageProcessor.from_config(QWEN_CONFIGS[cfg]), [IMAGES[name]])


@pytest.mark.parametrize("cfg", QWEN_CONFIGS, ids=str)
def test_qwen_batch_matches_transformers(cfg):
    compare(qwen_reference(QWEN_CONFIGS[cfg]), Qwen3VLImageProcessor.from_config(QWEN_CONFIGS[cfg]),
            list(IMAGES.values()))


@pytest.mark.parametrize("name", IMAGES)
@pytest.mark.parametrize("cfg", KIMI_CONFIGS, ids=str)
def test_kimi_matches_transformers(cfg, name):
    compare(kimi_reference(KIMI_CONFIGS[cfg]), KimiK25ImageProcessor.from_config(KIMI_CONFIGS[cfg]), [IMAGES[name]])


def test_kimi_batch_matches_transformers():
    compare(kimi_reference({}), KimiK25ImageProcessor(), list(IMAGES.values()))


def test_qwen_config_keys():
    p = Qwen3VLImageProcessor.from_config({"min_pixels": 100, "max_pixels": 200, "size": {"shortest_edge": 1,
                                                                                         "longest_edge": 2}})
    assert (p.min_pixels, p.max_pixels) == (100, 200)  # top-level min/max_pixels win over size, as in transformers
    assert Qwen3VLImageProcessor.from_config({}) == Qwen3VLImageProcessor()


def test_qwen_rows_are_merge_windows_of_tiled_frames():
    """The layout itself, without transformers: row r of window (i, j) holds patch (2i + r//2, 2j + r%2),
    its C*T*P*P values are channel-major with the same P*P values for each of the T frames."""
    p = Qwen3VLImageProcessor(patch_size=2, temporal_patch_size=2, merge_size=2, min_pixels=16, max_pixels=64,
                              image_mean=(0.0,) * 3, image_std=(1.0,) * 3, rescale_factor=1.0)
    x = torch.arange(3 * 4 * 8, dtype=torch.float32).view(3, 4, 8)  # [C, H, W]: gh=2, gw=4
    rows = p.patchify(x).view(8, 3, 2, 2, 2)  # [N, C, T, P, P]
    assert torch.equal(rows[:, :, 0], rows[:, :, 1])
    order = [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
    for n, (gy, gx) in enumerate(order):
        assert torch.equal(rows[n, :, 0], x[:, 2 * gy:2 * gy + 2, 2 * gx:2 * gx + 2])


def test_kimi_unscaled_image_is_normalised_and_padded():
    """Without transformers: an image inside the budget is not resized, only padded with zero pixels (-1
    after normalising) to whole 2x2 windows of 14-pixel patches, and cut into raster-order patches."""
    img = noise(30, 20, seed=7)
    out = KimiK25ImageProcessor()([img])
    assert out.grid_thw.tolist() == [[1, 2, 4]] and out.num_tokens == [2]
    full = -torch.ones(3, 28, 56)
    full[:, :20, :30] = torch.from_numpy(np.array(img)).permute(2, 0, 1).float() / 255 * 2 - 1
    patches = full.view(3, 2, 14, 4, 14).permute(1, 3, 0, 2, 4).reshape(8, 3, 14, 14)
    assert (out.pixel_values - patches).abs().max().item() <= ATOL


def test_kimi_release_media_proc_cfg():
    """The release's own keys (which transformers ignores) are read, and win over transformers' keys."""
    cfg = {"max_patches": 9, "media_proc_cfg": {"in_patch_limit": 1024, "patch_limit_on_one_side": 32,
                                                 "merge_kernel_size": [2, 2], "image_mean": [0.1, 0.2, 0.3]}}
    p = KimiK25ImageProcessor.from_config(cfg)
    assert (p.max_patches, p.max_patches_per_side, p.merge_size, p.image_mean) == (1024, 32, 2, (0.1, 0.2, 0.3))
    assert KimiK25ImageProcessor.from_config({}) == KimiK25ImageProcessor()


def test_resize_rules():
    assert smart_resize(91, 37, 28, 56 * 56, 28 * 28 * 1280) == (112, 56)  # 84x28 is under min_pixels
    assert smart_resize(7, 5, 28, 56 * 56, 10**6) == (84, 56)  # upscaled to min_pixels
    h, w = smart_resize(3000, 2000, 32, 1024, 100_000)
    assert h * w <= 100_000 and h % 32 == 0 and w % 32 == 0
    assert navit_resize(20, 30, 14, 2, 16384, 512) == ((20, 30), (28, 56))  # never upscaled
    (h, w), (ph, pw) = navit_resize(1000, 1000, 14, 2, 400, 512)
    assert (h // 14) * (w // 14) <= 400 and ph % 28 == 0 and pw % 28 == 0
    assert navit_resize(10000, 50, 14, 2, 10**6, 64)[0][0] == 64 * 14  # per-side limit


def test_bytes_and_images_agree():
    img = IMAGES["odd-37x91"]
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    for proc in (Qwen3VLImageProcessor(), KimiK25ImageProcessor()):
        a, b = proc([img]), proc([buf.getvalue()])
        assert torch.equal(a.pixel_values, b.pixel_values) and a.num_tokens == b.num_tokens


def test_no_images():
    out = Qwen3VLImageProcessor()([])
    assert out.pixel_values.shape == (0, 3 * 2 * 14 * 14) and out.grid_thw.shape == (0, 3) and out.num_tokens == []
    assert KimiK25ImageProcessor()([]).pixel_values.shape == (0, 3, 14, 14)


def test_extreme_aspect_ratio_refused():
    with pytest.raises(ValueError, match="aspect ratio"):
        Qwen3VLImageProcessor()([Image.new("RGB", (2010, 10))])


def test_bad_bytes_refused():
    with pytest.raises(ValueError, match="cannot be decoded"):
        KimiK25ImageProcessor()([b"not an image"])
