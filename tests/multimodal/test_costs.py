"""The vision encoder in the memory accounting: `dayzero inspect` counts the tower's parameters, `dayzero plan`
its weights and the encoder's transient (one call of the largest image, the feature cache), `predict_allocation`
matches what the engine allocates with the tower, the engine sets the encoder's bytes aside before sizing its
cache, and a step's images are encoded in calls of at most the largest image's patch rows."""
from __future__ import annotations

import pytest

from dayzero import LLM, SamplingParams
from dayzero.multimodal.costs import cache_rows, encoder_bytes, max_image_rows
from dayzero.tools.inspect import inspect
from dayzero.tools.model_info import VISION, count_params, load
from dayzero.tools.plan import Layout, PlanConfig, memory, predict_allocation
from dayzero.tools.plan_costs import model_costs
from tests.multimodal.vl_checkpoints import image_prompt, make_checkpoint, noise_image

pytest.importorskip("transformers.models.qwen3_5_moe")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_5_moe")
    make_checkpoint(path, "qwen3_5_moe")
    return path


def test_inspect_and_plan_count_the_tower(ckpt):
    info = load(str(ckpt))
    tower = sum(p.logical for p in info.params if p.component == VISION)
    assert tower == sum(p.numel() for p in info.tower.parameters()) > 0
    assert count_params(info)["by_component"][VISION]["total"] == tower
    report = inspect(str(ckpt))
    assert VISION in str(report)
    costs = model_costs(info)
    assert costs.vision_bytes == tower * info.spec.dtype.itemsize
    m = memory(costs, PlanConfig(), Layout(1, 1, 1, 1), 256)  # prefill chunk min(8192, context)
    assert m["encoder"] == pytest.approx(costs.encoder_call_bytes + cache_rows(256) * costs.encoder_row_bytes)
    assert costs.encoder_call_bytes > 0 and costs.encoder_row_bytes > 0


def test_prediction_matches_the_engine_with_its_tower(ckpt):
    L, B = 256, 2
    llm = LLM(str(ckpt), device="cpu", dtype="float32", max_num_seqs=B, max_model_len=L, cache_memory_bytes=1 << 30)
    eng = llm.engine
    weights = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    assert sum(p.numel() for p in eng.model.visual.parameters()) > 0
    assert predict_allocation(str(ckpt), "fp32", L, B)["weights"] == pytest.approx(weights, rel=0.10)
    want = encoder_bytes(eng.model.visual, eng.images.processor, 2048, 4)
    assert eng.cache_plan.scratch_bytes >= want > 0


def test_images_past_one_calls_rows_take_several_calls(ckpt):
    llm = LLM(str(ckpt), device="cpu", dtype="float32", max_num_seqs=2, max_model_len=512)
    eng = llm.engine
    images = [noise_image(64, 96, 1), noise_image(96, 64, 2), noise_image(80, 80, 3)]
    rows = [eng.images.processor([im]).pixel_values.shape[0] for im in images]
    assert max_image_rows(eng.images.processor) >= max(rows)
    eng.images.max_call_rows = rows[0] + rows[1]  # the first two fit one call, the third needs another
    eng.add_request("r", image_prompt([5, "img", 7, "img", "img", 8]),
                    SamplingParams(max_tokens=1, temperature=0.0), images=images)
    while eng.has_unfinished():
        eng.step()
    assert eng.stats()["encoder_calls"] == 2 and eng.stats()["encoder_runs"] == 3
