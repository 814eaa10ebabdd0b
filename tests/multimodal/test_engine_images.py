"""Images through the engine against transformers' own vision-language models (qwen3_5_moe, qwen3_vl_moe),
tiny random checkpoints in fp32 on the CPU.

One batch holds a prompt with one image, one with two images of different sizes and one with none: prompt
logits within 1e-4 relative of transformers' no-cache forward with the same pixel rows, and 16 greedy tokens
equal to transformers' (a full forward per token). Prefill chunks that cut through an image, the same image in
two requests (encoded once), preemption by recompute, the prefix cache with equal placeholder ids but
different images, and every refusal are checked too.
"""
from __future__ import annotations

import pytest
import torch

from dayzero import LLM, SamplingParams
from tests.multimodal.vl_checkpoints import (engine_logits, hf_greedy, hf_logits, image_prompt, make_checkpoint,
                                             noise_image, text_ids)

FAMILIES = ("qwen3_5_moe", "qwen3_vl_moe")
RTOL = 1e-4
NEW_TOKENS = 16
IMAGES = {"wide": noise_image(128, 64, seed=1), "tall": noise_image(64, 96, seed=2), "square": noise_image(96, 96, seed=3)}
# (parts, images): text runs and image placeholders
PROMPTS = {
    "one-image": ([5, "img", 7], ["wide"]),
    "two-sizes": ([3, "img", 4, "img", 6], ["tall", "square"]),
    "text-only": ([19], []),
}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_checkpoint(path, request.param)
    return path, hf


def llm_of(path, **kw) -> LLM:
    args = dict(device="cpu", dtype="float32", block_size=4, num_cache_blocks=512, max_num_batched_tokens=64)
    return LLM(str(path), **(args | kw))


def prompts():
    return [(image_prompt(parts), [IMAGES[k] for k in names]) for parts, names in PROMPTS.values()]


def references(llm, hf, batch):
    """transformers' (prompt logits, greedy tokens) of each prompt."""
    out = []
    for ids, images in batch:
        wide, _ = llm.engine._with_images(list(ids), images)
        inputs = llm.engine.images.processor(images) if images else None
        out.append((hf_logits(hf, wide, inputs), hf_greedy(hf, wide, inputs, NEW_TOKENS)))
    return out


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def generate(llm, batch):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": images}} for ids, images in batch],
                        params)
    return [o.outputs[0].token_ids for o in outs]


def check_tokens(ours, refs):
    for got, (_, want) in zip(ours, refs):
        assert len(want) >= NEW_TOKENS // 2, "the reference hits a near-tie early; pick another seed"
        assert got[:len(want)] == want, f"ours {got} vs transformers {want}"


@pytest.fixture(scope="module")
def reference(family):
    path, hf = family
    llm = llm_of(path)
    return llm, references(llm, hf, prompts())


def test_prompt_logits_and_greedy_in_one_batch(reference):
    llm, refs = reference
    batch = prompts()
    for (logits, _), ours in zip(refs, engine_logits(llm.engine, batch, 64)):
        assert rel(ours, logits) <= RTOL
    check_tokens(generate(llm, batch), refs)
    stats = llm.engine.stats()
    assert stats["encoder_runs"] >= 3 and stats["running"] == 0


def test_usage_counts_image_tokens(reference):
    llm, _ = reference
    ids, images = prompts()[1]
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}},
                       SamplingParams(max_tokens=1, temperature=0.0))[0]
    tokens = sum(llm.engine.images.processor([im]).num_tokens[0] for im in images)
    assert len(out.prompt_token_ids) == len(ids) - len(images) + tokens


@pytest.mark.parametrize("chunks", [[6, 3, 64], [1] * 8 + [64], [9, 2, 5, 64]], ids=str)
def test_chunks_cutting_through_images(reference, chunks):
    """The two-image prompt's images start at 4 and 11: these chunks end inside them."""
    llm, refs = reference
    ids, images = prompts()[1]
    ours = engine_logits(llm.engine, [(ids, images)], chunks)[0]
    assert rel(ours, refs[1][0]) <= RTOL


def test_scheduler_chunks_and_preemption(family, reference):
    """A step budget of 5 tokens cuts every image; a cache of a few blocks preempts sequences in between."""
    path, _ = family
    _, refs = reference
    small = llm_of(path, max_num_batched_tokens=5, num_cache_blocks=24, enable_prefix_caching=False)
    check_tokens(generate(small, prompts()), refs)
    assert small.engine.stats()["preemptions"] > 0


def test_same_image_encoded_once(family, reference):
    path, _ = family
    _, refs = reference
    llm = llm_of(path, enable_prefix_caching=False)
    ids, images = prompts()[0]
    check_tokens(generate(llm, [(ids, images), (ids, images)]), [refs[0], refs[0]])
    stats = llm.engine.stats()
    assert stats["encoder_runs"] == 1 and stats["encoder_cache_hits"] == 1


def test_prefix_cache_keys_images(family, reference):
    """Equal prompt ids with a different image share no image block; with the same image they do."""
    path, hf = family
    llm = llm_of(path)
    ids, _ = prompts()[0]
    other = [IMAGES["square"]]
    want = references(llm, hf, [(ids, other)])
    generate(llm, [(ids, [IMAGES["wide"]])])
    before = llm.engine.stats()["prefix_hit_tokens"]
    check_tokens(generate(llm, [(ids, other)]), want)
    start = ids.index(299)  # blocks before the image may be shared, none after it
    assert llm.engine.stats()["prefix_hit_tokens"] - before <= start
    generate(llm, [(ids, other)])
    assert llm.engine.stats()["prefix_hit_tokens"] - before > start


def test_refusals(family, reference):
    llm, _ = reference
    ids, images = prompts()[1]
    with pytest.raises(ValueError, match="2 image placeholder token.*1 image"):
        llm.engine.add_request("a", ids, SamplingParams(max_tokens=2), images=images[:1])
    with pytest.raises(ValueError, match="placeholder"):
        llm.engine.add_request("b", ids, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="image"):
        llm.engine.add_request("c", ids, SamplingParams(max_tokens=2), images=[b"not an image", images[1]])
    short = llm_of(family[0], max_model_len=len(ids) + 4)
    with pytest.raises(ValueError, match="expanded to .* image tokens; the context length is"):
        short.engine.add_request("d", ids, SamplingParams(max_tokens=2), images=images)
    assert not llm.engine.has_unfinished()


def test_text_only_model_refuses_images():
    llm = LLM(device="cpu", dtype="float32")  # the bundled text-only model
    with pytest.raises(ValueError, match="does not take images"):
        llm.engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2), images=[IMAGES["wide"]])
    assert llm.engine.stats()["encoder_runs"] == 0
