"""Images through the engine against transformers' own vision-language models (qwen3_5_moe, qwen3_vl_moe,
kimi_k25), tiny random checkpoints in fp32 on the CPU.

One batch holds a prompt with one image, one with two images of different sizes and one with none: prompt
logits within 1e-4 relative of transformers' no-cache forward with the same pixel rows, and 16 greedy tokens
equal to transformers' (a full forward per token). Prefill chunks that cut through an image, the same image in
two requests (encoded once), preemption by recompute, the prefix cache with equal placeholder ids but
different images, and every refusal are checked too. A Kimi-K2.5 checkpoint in the release's layout loads to
the same outputs as transformers' save of it.
"""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dayzero import LLM, SamplingParams
from tests.multimodal.vl_checkpoints import (engine_logits, hf_greedy, hf_logits, image_prompt, make_checkpoint,
                                             noise_image, text_ids)

FAMILIES = ("qwen3_5_moe", "qwen3_vl_moe", "kimi_k25")
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
        wide, _ = llm.engine.prepare_prompt(list(ids), images)
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


def kimi_release_tensors(hf) -> dict:
    """The Kimi-K2.5 release's layout of transformers' model ``hf``, from its in-memory parameters: MoonViT names
    (``encoder.blocks``, ``norm0/1``, ``wo``, ``mlp.fc0/1``, ``pos_emb.weight``, ``mm_projector.proj.0/2``), q/k/v
    fused as ``wqkv`` with each head's q/k rows back in complex-pair (interleaved) order, and the decoder layers
    under ``language_model.model.layers``."""
    heads = hf.config.vision_config.num_attention_heads
    names = {"norm1": "norm0", "norm2": "norm1", "mlp.fc1": "mlp.fc0", "mlp.fc2": "mlp.fc1", "attn.proj": "wo"}

    def pairs(t):  # rotate-half rows of each head -> interleaved pairs: row i -> 2i, Dh/2 + i -> 2i + 1
        return t.reshape(heads, 2, -1, *t.shape[1:]).transpose(1, 2).reshape(t.shape)

    out = {}
    for name, t in hf.state_dict().items():
        t = t.contiguous()
        if name.startswith("model.language_model."):
            out[name.replace("model.language_model.", "language_model.model.")] = t
        elif name == "lm_head.weight":
            out["language_model.lm_head.weight"] = t
        elif name.startswith("model.mm_projector."):
            leaf = name.removeprefix("model.mm_projector.")
            out["mm_projector." + leaf.replace("in_proj", "proj.0").replace("out_proj", "proj.2")] = t
        elif name.startswith("model.vision_tower.layers."):
            i, leaf = name.removeprefix("model.vision_tower.layers.").split(".", 1)
            block = f"vision_tower.encoder.blocks.{i}."
            if leaf.startswith("attn.q_proj."):
                q, k, v = (hf.state_dict()[name.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj"))
                out[block + "wqkv." + leaf.rsplit(".", 1)[1]] = torch.cat([pairs(q), pairs(k), v])
            elif not leaf.startswith(("attn.k_proj.", "attn.v_proj.")):
                module, param = leaf.rsplit(".", 1)
                out[block + names.get(module, module) + "." + param] = t
        elif name == "model.vision_tower.patch_embed.pos_emb.position_embeddings":
            out["vision_tower.patch_embed.pos_emb.weight"] = t
        elif name.startswith("model.vision_tower.final_layernorm."):
            out[name.replace("model.vision_tower.", "vision_tower.encoder.")] = t
        else:  # patch_embed.proj
            out[name.removeprefix("model.")] = t
    return out


def test_kimi_release_layout(tmp_path):
    """The release's names and interleaved ``wqkv`` load to the outputs of transformers' save; transformers writes
    the same fused tensors, under two names of its own."""
    hf = make_checkpoint(tmp_path / "hf", "kimi_k25")
    released = kimi_release_tensors(hf)
    saved = load_file(tmp_path / "hf" / "model.safetensors")
    vision = {n for n in released if not n.startswith("language_model.")}
    assert vision - saved.keys() == {"vision_tower.patch_embed.proj.weight", "vision_tower.patch_embed.proj.bias",
                                     "mm_projector.pre_norm.weight", "mm_projector.pre_norm.bias"}
    assert all(torch.equal(released[n], saved[n]) for n in vision & saved.keys())  # wqkv included
    (tmp_path / "released").mkdir()
    for f in ("config.json", "preprocessor_config.json"):
        shutil.copy(tmp_path / "hf" / f, tmp_path / "released")
    save_file(released, tmp_path / "released" / "model.safetensors")
    batch, llm = prompts(), llm_of(tmp_path / "released")
    ours = engine_logits(llm.engine, batch, 64)
    theirs = engine_logits(llm_of(tmp_path / "hf").engine, batch, 64)
    for (ids, images), a, b in zip(batch, ours, theirs):
        assert torch.equal(a, b)
        wide, _ = llm.engine.prepare_prompt(list(ids), images)
        inputs = llm.engine.images.processor(images) if images else None
        assert rel(a, hf_logits(hf, wide, inputs)) <= RTOL


def test_text_only_model_refuses_images():
    llm = LLM(device="cpu", dtype="float32")  # the bundled text-only model
    with pytest.raises(ValueError, match="does not take images"):
        llm.engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2), images=[IMAGES["wide"]])
    assert llm.engine.stats()["encoder_runs"] == 0


def test_a_tower_that_cannot_take_images_says_why(tmp_path):
    """transformers' default projection width beside a narrower Kimi tower: the text model loads alone, and an
    image is refused with that reason, not as a model without a tower."""
    from tests.hf.test_vl_text_families import _checkpoint

    _checkpoint(tmp_path, "kimi_k25")  # projection_hidden_size left at transformers' 1152, the tower 32 wide
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=64)
    assert llm.engine.images is None
    with pytest.raises(ValueError, match="does not take images .*projection_hidden_size"):
        llm.engine.add_request("a", [5, 6, 299], SamplingParams(max_tokens=2), images=[IMAGES["wide"]])
