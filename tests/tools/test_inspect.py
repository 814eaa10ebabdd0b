"""dayzero inspect: structure from config.json alone, header-only checkpoint alignment, parameter counts
against instantiated models and against published counts of released models."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from dayzero.cli import main as cli
from dayzero.models.registry import ARCHITECTURES, _load_adapters, build_model
from dayzero.multimodal.families import vision_family
from dayzero.tools.inspect import compress, inspect
from tests.conftest import CONFIGS
from tests.tools.released_configs import RELEASED
from tests.tools.tiny_configs import tiny_config

_load_adapters()


def test_compress_layer_kinds():
    assert compress(["KDA+dense", "KDA", "KDA", "DSA"] + ["KDA", "KDA", "KDA", "DSA"] * 15) == \
        "KDA+dense×1, KDA×2, DSA×1, then [KDA×3, DSA×1] repeated 15×"
    assert compress(["SWA", "GQA"] * 18) == "[SWA×1, GQA×1] repeated 18×"
    assert compress(["GQA"] * 5) == "GQA×5"


def test_bad_checkpoint_is_caught_from_headers_alone(tmp_path, tiny_ckpt_no_tokenizer, monkeypatch):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt_no_tokenizer, ckpt)
    tensors = load_file(str(ckpt / "model.safetensors"))
    wrong, gone = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.kv_b_proj.weight"
    tensors[wrong] = tensors[wrong][:-1].contiguous()
    del tensors[gone]
    save_file(tensors, str(ckpt / "model.safetensors"))

    import safetensors
    import safetensors.torch

    def no_data(*a, **k):
        raise AssertionError("inspect read tensor data")

    monkeypatch.setattr(safetensors, "safe_open", no_data)
    monkeypatch.setattr(safetensors.torch, "load_file", no_data)
    monkeypatch.setattr("dayzero.loader.safetensors_loader.safe_open", no_data)
    r = inspect(str(ckpt))
    found = {(m["kind"], m["tensor"]): m for m in r["checkpoint_check"]["mismatches"]}
    assert found[("shape", wrong)]["file"] == "model.safetensors" and "(31, 64)" in found[("shape", wrong)]["detail"]
    assert ("missing", gone) in found
    assert len(found) == 2 and not r["ok"]
    assert cli(["inspect", str(ckpt)]) == 1
    assert cli(["inspect", str(tiny_ckpt_no_tokenizer)]) == 0


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_counts_equal_the_instantiated_model(model_type, write_config):
    cfg = tiny_config(model_type)
    r = inspect(str(write_config(cfg)))
    adapter = ARCHITECTURES[model_type]
    model = build_model(adapter.to_spec(cfg), torch.float32, "cpu")
    family = vision_family(cfg)  # a vision-language config: its tower counts too (built on the meta device)
    with torch.device("meta"):
        tower = sum(p.numel() for p in family.build(cfg).parameters()) if family is not None else 0
    assert r["params_total"] == sum(p.numel() for p in model.parameters()) + tower
    assert sum(c["total"] for c in r["params_by_component"].values()) == r["params_total"]
    assert r["num_layers"] == len(r["layer_kinds"]) == len(model.model.layers)
    moe = [l.mlp for l in model.config.layers if l.mlp_kind == "moe"]
    routed = sum(p.numel() for n, p in model.named_parameters() if n.split(".")[-1] in ("w1", "w2", "b1", "b2"))
    frac = moe[0].top_k / moe[0].n_experts if moe else 1.0
    assert r["params_active"] == pytest.approx(r["params_total"] - routed * (1 - frac), abs=2)


def test_the_2p8t_config_on_a_laptop():
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "dayzero.cli", "inspect", str(CONFIGS / "dayzero-2.8t.json"), "--json"],
                         capture_output=True, text=True, timeout=300)
    took = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert 2.7e12 <= r["params_total"] <= 2.9e12
    assert (r["experts_active"], r["experts_routed"]) == (16, 896)
    assert r["num_layers"] == 64 and r["layer_kinds"].count("kda") == 48 and r["layer_kinds"].count("dsa") == 16
    assert r["params_active"] < r["params_total"] / 20
    assert r["layer_pattern"] == "KDA+dense×1, KDA×2, DSA×1, then [KDA×3, DSA×1] repeated 15×"
    # DSA: latent (512 + 64) + indexer key (128), bf16, per token per layer; KDA: one state per sequence
    assert r["cache_bytes_per_token"] == 16 * (576 + 128) * 2
    assert r["cache"]["by_kind"]["kda"]["state_bytes_per_seq_per_layer"] == 64 * 128 * 128 * 4 + 3 * 64 * 128 * 3 * 2
    assert set(r["cache"]["per_sequence"]) == {"4K", "128K", "1M"}
    assert took < 60


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_published_parameter_counts(name, write_config):
    raw, (total, active), convention, tol = RELEASED[name]
    if raw["model_type"] not in ARCHITECTURES:
        pytest.skip(f"no adapter for {raw['model_type']} yet")
    r = inspect(str(write_config(raw)))
    got_active = {"all": r["params_active"], "no_input_embedding": r["params_active_excl_input_embedding"],
                  "excl_embeddings": r["params_active_excl_embeddings"]}[convention]
    assert r["params_total"] == pytest.approx(total, rel=tol)
    assert got_active == pytest.approx(active, rel=tol)


def test_weights_as_stored_follow_quantization_config(write_config):
    raw = RELEASED["gpt-oss-120b"][0]
    if raw["model_type"] not in ARCHITECTURES:
        pytest.skip("no gpt_oss adapter")
    r = inspect(str(write_config(raw)))
    # the released MXFP4 checkpoint is 60.8 GiB: experts at 4.25 bits, everything else bf16
    assert r["weights"]["bytes"] / 2**30 == pytest.approx(60.8, rel=0.02)
    assert set(r["weights"]["by_format"]) >= {"MXFP4", "BF16"}
    ds = inspect(str(write_config(RELEASED["DeepSeek-V3"][0], "ds")))
    assert ds["weights"]["by_format"]["FP8"] > 0.95 * ds["weights"]["bytes"]


def test_sliding_window_layers_hold_their_window(write_config):
    """gpt-oss-120b: a sequence's cache grows only in its 18 full-attention layers; the 18 windowed ones hold the
    blocks of their last 128 keys (9 blocks of 16: the window may straddle one more)."""
    from dayzero.tools.inspect import cache_report
    from dayzero.tools.model_info import load

    c = cache_report(load(str(write_config(RELEASED["gpt-oss-120b"][0]))))
    per_layer_token = 2 * 8 * 64 * 2  # k and v, 8 kv heads of 64, bf16
    assert c["by_kind"]["gqa, window 128"]["layers"] == 18 and c["by_kind"]["gqa"]["layers"] == 18
    assert c["per_sequence"]["128K"] == 18 * per_layer_token * (131072 + 9 * 16)
