"""deepseek_v4 in the release's own format: unprefixed names (``embed.weight``, ``layers.0.attn.wq_a``,
``hc_head_fn``), FP8 E4M3 linears with UE8M0 128×128 tile scales (``.scale``), routed experts as packed FP4
(two E2M1 codes per int8 byte) with UE8M0 scales per 32 values, compressor projections in high precision.

The checkpoint is made here from transformers' tiny random model with this file's own quantiser, and the
reference is transformers running the dequantised weights (dequantised here too, from the E2M1 table and
2^(byte - 127)); dayzero keeps the linears in FP8 and the experts packed.
"""
from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from dayzero import LLM
from dayzero.layers.fp8_linear import BlockFp8Linear
from dayzero.layers.parallel import Linear
from tests.hf.harness import block_kernels, check_parity, make_hf_checkpoint, prompt_batch
from tests.hf.test_deepseek_v4 import CONFIG, _init

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
FP8_LINEARS = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "indexer.wq_b", "shared_experts.w1",
               "shared_experts.w2", "shared_experts.w3")
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128],
         "activation_scheme": "dynamic", "expert_dtype": "fp4"}


def _pow2_exponent(amax: torch.Tensor, top: float) -> torch.Tensor:
    """The smallest power-of-two exponent e with amax / 2^e <= top."""
    return torch.ceil(torch.log2(amax.clamp_min(1e-30) / top))


def quantize_fp8_ue8m0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, UE8M0 scale bytes [ceil(N/128), ceil(K/128)], dequantised fp32)."""
    N, K = w.shape
    tiles = torch.nn.functional.pad(w, (0, -K % 128, 0, -N % 128)).unflatten(0, (-1, 128)).unflatten(2, (-1, 128))
    e = _pow2_exponent(tiles.abs().amax(dim=(1, 3)), 448.0)  # [N/128, K/128]
    scale = torch.exp2(e).repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
    q = (w / scale).to(torch.float8_e4m3fn)
    return q, (e + 127).to(torch.uint8), q.float() * scale


def quantize_fp4_ue8m0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed int8 [N, K/2], UE8M0 scale bytes [N, K/32], dequantised fp32): nearest E2M1 code per value."""
    N, K = w.shape
    blocks = w.view(N, K // 32, 32)
    e = _pow2_exponent(blocks.abs().amax(-1), 6.0)  # [N, K/32]
    codes = (blocks / torch.exp2(e)[..., None])[..., None].sub(E2M1).abs().argmin(-1).view(N, K)  # [N, K]
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)  # low nibble first
    return packed, (e + 127).to(torch.uint8), (E2M1[codes].view(N, K // 32, 32) * torch.exp2(e)[..., None]).view(N, K)


def release_name(name: str) -> str:
    for a, b in (("model.embed_tokens.", "embed."), ("model.norm.", "norm."), ("model.hc_head.hc_", "hc_head_"),
                 ("model.layers.", "layers.")):
        if name.startswith(a):
            return b + name[len(a):]
    return name


def test_release_format_matches_transformers_on_dequantized_weights(tmp_path):
    cfg = {**CONFIG, "moe_intermediate_size": 128}  # expert widths that FP4 blocks of 32 and FP8 tiles divide
    make_hf_checkpoint(tmp_path / "bf16", "deepseek_v4", seed=1, init=_init, **cfg)
    saved = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    release, dequantized = {}, {}
    for name, t in saved.items():
        base = name.removesuffix(".weight")
        if name.endswith(".weight") and base.endswith(FP8_LINEARS):
            q, scale, dequantized[name] = quantize_fp8_ue8m0(t.float())
        elif name.endswith(".weight") and ".ffn.experts." in name:
            q, scale, dequantized[name] = quantize_fp4_ue8m0(t.float())
        else:
            release[release_name(name)] = t
            continue
        release[release_name(name)] = q
        release[release_name(base) + ".scale"] = scale.view(torch.float8_e8m0fnu)
    assert "embed.weight" in release and "layers.1.attn.compressor.wkv.weight" in release and "hc_head_fn" in release
    raw = json.loads((tmp_path / "bf16" / "config.json").read_text())
    (tmp_path / "release").mkdir()
    (tmp_path / "release" / "config.json").write_text(json.dumps({**raw, "quantization_config": QUANT}))
    save_file(release, str(tmp_path / "release" / "model.safetensors"))

    (tmp_path / "ref").mkdir()
    (tmp_path / "ref" / "config.json").write_text(json.dumps(raw))
    save_file({**saved, **dequantized}, str(tmp_path / "ref" / "model.safetensors"))
    block_kernels()
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ref"), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0

    engine = LLM(str(tmp_path / "release"), device="cpu", dtype="float32", num_cache_blocks=64).engine
    layer = engine.model.model.layers[1]
    assert isinstance(layer.self_attn.q_a_proj, BlockFp8Linear) and isinstance(layer.mlp.shared_experts.down_proj, BlockFp8Linear)
    assert type(layer.self_attn.compressor.kv_proj) is Linear  # stored in high precision, no scale
    assert type(layer.self_attn.indexer.compressor.gate_proj) is Linear
    assert layer.mlp.packed and len(engine.packed_moe_layers) == cfg["num_hidden_layers"]
    check_parity(tmp_path / "release", hf, prompt_batch(cfg["vocab_size"]))
