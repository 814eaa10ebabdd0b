"""Image + text requests, dayzero against transformers in one run, on the same random qwen3_5_moe checkpoint.

    python benchmarks/vision_throughput.py --device cuda --batch 1 8 32 --image-size 448 --decode 32 --json vs_hf_images.json
    python benchmarks/vision_throughput.py --tiny --device cpu --batch 1 2 --image-size 64 --decode 4

transformers builds a random ``qwen3_5_moe`` vision-language model (about 5.5B parameters: the Gated DeltaNet
+ gated attention + 64-expert MoE text model of ``benchmarks/vs_transformers.py``'s size and a 12-block
Qwen3-VL vision tower; ``--tiny``: a few hundred thousand) on the device, bf16 on a GPU and fp32 on the CPU,
and saves it with a preprocessor config. Each prompt is ``--text-len`` random tokens, one image of
``--image-size`` pixels square (random noise, different per prompt), then ``--text-len`` more tokens; all prompts
have the same length, so transformers' ``generate`` needs no padding. Both engines get the same pixel rows:
transformers the processor's ``pixel_values`` / ``image_grid_thw`` (dayzero's processor, which equals
transformers' own, ``tests/multimodal``), dayzero the Pillow images (its preprocessing and encoding inside the
timed prefill). Per batch size: a warm-up on other images, then a 1-token run (prefill: time to first token for
the whole batch) and a 1 + N-token run (greedy, EOS ignored); transformers' decode tok/s is B·N over the
difference, dayzero's is timed over its own decode steps.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_transformers import _free, _params, _sync, environment, log  # noqa: E402

IMAGE, V_START, V_END = 248056, 248053, 248054  # Qwen3.5's image placeholder and its brackets
TEXT = dict(vocab_size=248320, hidden_size=2048, num_hidden_layers=24,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6, num_attention_heads=16,
            num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
            linear_key_head_dim=128, linear_value_head_dim=128, num_experts=64, num_experts_per_tok=8,
            moe_intermediate_size=512, shared_expert_intermediate_size=512, max_position_embeddings=32768,
            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                             "mrope_section": [11, 11, 10], "mrope_interleaved": True})
VISION = dict(depth=12, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048, patch_size=16,
              spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304)
TINY_TEXT = dict(vocab_size=300, hidden_size=64, num_hidden_layers=3,
                 layer_types=["linear_attention", "full_attention", "linear_attention"], num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=8, linear_value_head_dim=12, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=24, shared_expert_intermediate_size=40, max_position_embeddings=1024,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                  "mrope_section": [2, 1, 1], "mrope_interleaved": True})
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=16,
                   spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64)
TINY_IDS = dict(image_token_id=299, vision_start_token_id=297, vision_end_token_id=298)


def model_config(tiny: bool) -> dict:
    ids = TINY_IDS if tiny else dict(image_token_id=IMAGE, vision_start_token_id=V_START, vision_end_token_id=V_END)
    text = {**(TINY_TEXT if tiny else TEXT), "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    return {"text_config": text, "vision_config": TINY_VISION if tiny else VISION, "tie_word_embeddings": False, **ids}


def build_checkpoint(config: dict, path: Path, dev: torch.device, dtype: torch.dtype, size: int):
    """transformers' own random model on ``dev``, saved to ``path`` with a preprocessor config whose pixel bounds
    keep a ``size``-pixel square image as it is; returns (model, parameters)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    t = time.perf_counter()
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("qwen3_5_moe", **config)
    with torch.device(dev):
        model = AutoModelForImageTextToText.from_config(cfg, dtype=dtype).eval()
    n = sum(p.numel() for p in model.parameters())
    log(f"qwen3_5_moe: {_params(n)} parameters built by transformers in {time.perf_counter() - t:.1f}s")
    model.save_pretrained(str(path))
    v = config["vision_config"]
    cell = v["patch_size"] * v["spatial_merge_size"]
    pre = {"patch_size": v["patch_size"], "temporal_patch_size": v["temporal_patch_size"],
           "merge_size": v["spatial_merge_size"], "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
           "size": {"shortest_edge": cell * cell, "longest_edge": max(size * size, cell * cell)}}
    (path / "preprocessor_config.json").write_text(json.dumps(pre))
    return model, n


def prompts(config: dict, batch: int, text_len: int, size: int, seed: int):
    """``batch`` (token ids with one placeholder, Pillow image) pairs."""
    rng = np.random.default_rng(seed)
    ids = config["image_token_id"], config["vision_start_token_id"], config["vision_end_token_id"]
    top = min(ids)  # random text stays below the vision tokens
    out = []
    for _ in range(batch):
        text = rng.integers(3, top, 2 * text_len).tolist()
        img = Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8), "RGB")
        out.append((text[:text_len] + [ids[1], ids[0], ids[2]] + text[text_len:], img))
    return out


def hf_run(model, processor, image_token: int, dev: torch.device):
    from dayzero.multimodal.inputs import expand_placeholders

    def run(batch, new):
        inputs = processor([img for _, img in batch])
        per = inputs.num_tokens[0]
        ids = torch.tensor([expand_placeholders(p, image_token, [per])[0] for p, _ in batch], device=dev)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             pixel_values=inputs.pixel_values.to(dev, model.dtype),
                             image_grid_thw=inputs.grid_thw.to(dev), mm_token_type_ids=(ids == image_token).int(),
                             max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        return out[0, ids.shape[1]:].tolist(), ids.shape[1]
    return run


def dayzero_run(llm, dev: torch.device):
    """Through the engine's step loop (``engine_throughput.timed``): the steps until every prompt is in the cache
    (images preprocessed, encoded and spliced inside them), then the decode steps, timed apart."""
    from engine_throughput import timed

    def run(batch, new):
        prefill, decode, _, seqs = timed(llm.engine, [ids for ids, _ in batch], new - 1, dev,
                                         images=[[img] for _, img in batch])
        return seqs[0].output_ids, seqs[0].num_prompt_tokens, prefill, decode
    return run


def measure(name: str, run, config: dict, batch: int, args, dev: torch.device) -> dict:
    run(prompts(config, batch, args.text_len, args.image_size, seed=1000 + batch), 2)  # warm-up
    work = prompts(config, batch, args.text_len, args.image_size, seed=batch)
    res = {}
    for new in (1, 1 + args.decode):
        _sync(dev)
        t = time.perf_counter()
        out = run(work, new)
        _sync(dev)
        res[new] = (time.perf_counter() - t, out)
    (pre_wall, pre), (full_wall, full) = res[1], res[1 + args.decode]
    tokens, length = full[0], full[1]
    if len(full) == 4:  # dayzero: its own phase times
        prefill_s, decode_tok_s = full[2], batch * args.decode / full[3]
    else:
        prefill_s = pre_wall
        decode_tok_s = batch * args.decode / (full_wall - pre_wall) if full_wall > pre_wall else None
    row = {"prompt_tokens": length, "prefill_s": prefill_s, "prefill_tok_s": batch * length / prefill_s,
           "decode_tok_s": decode_tok_s, "tokens": list(tokens)}
    log(f"{name} batch {batch}: prefill {row['prefill_tok_s']:,.0f} tok/s, decode {decode_tok_s or 0:,.1f} tok/s")
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--image-size", type=int, default=448, help="pixels per side of each prompt's image")
    ap.add_argument("--text-len", type=int, default=64, help="random tokens before and after the image")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--tiny", action="store_true", help="a tiny model (CPU tests)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from dayzero import LLM
    from dayzero.multimodal.processors import Qwen3VLImageProcessor

    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    config = model_config(args.tiny)
    root = Path(tempfile.mkdtemp(prefix="vision-bench-"))
    result = {"environment": environment(dev), "args": vars(args), "rows": []}
    try:
        model, result["parameters"] = build_checkpoint(config, root, dev, dtype, args.image_size)
        processor = Qwen3VLImageProcessor.from_config(json.loads((root / "preprocessor_config.json").read_text()))
        hf = {b: measure("transformers", hf_run(model, processor, config["image_token_id"], dev), config, b, args, dev)
              for b in args.batch}
        del model
        _free(dev)
        longest = hf[args.batch[0]]["prompt_tokens"] + args.decode + 1
        llm = LLM(str(root), device=dev.type, dtype=str(dtype).removeprefix("torch."), max_num_seqs=max(args.batch),
                  max_num_batched_tokens=max(args.batch) * longest, max_model_len=longest)
        log(f"dayzero: decode {llm.engine.decode_mode}")
        dz = {b: measure("dayzero", dayzero_run(llm, dev), config, b, args, dev) for b in args.batch}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\nqwen3_5_moe {_params(result['parameters'])}, one {args.image_size}px image per prompt of "
          f"{hf[args.batch[0]]['prompt_tokens']} tokens, on {result['environment']['device']}")
    print(f"{'batch':>5} {'prefill tok/s hf':>17} {'dayzero':>9} {'ratio':>6} {'decode tok/s hf':>16} {'dayzero':>9} "
          f"{'ratio':>6} {'same tokens':>12}")
    for b in args.batch:
        h, d = hf[b], dz[b]
        same = next((i for i, (x, y) in enumerate(zip(h["tokens"], d["tokens"])) if x != y),
                    min(len(h["tokens"]), len(d["tokens"])))
        ratio = d["decode_tok_s"] / h["decode_tok_s"] if h["decode_tok_s"] else None
        print(f"{b:>5} {h['prefill_tok_s']:>17,.0f} {d['prefill_tok_s']:>9,.0f} {d['prefill_tok_s'] / h['prefill_tok_s']:>5.2f}x "
              f"{h['decode_tok_s'] or 0:>16,.1f} {d['decode_tok_s']:>9,.1f} "
              f"{'-' if ratio is None else f'{ratio:.2f}x':>6} {same:>12}")
        result["rows"].append({"batch": b, "transformers": h, "dayzero": d, "same_tokens": same})
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return result


if __name__ == "__main__":
    main()
