"""Checkpoint faults from RELIABILITY.md stop the load with the file and the tensor named."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dayzero import LLM
from dayzero.loader.safetensors_loader import CheckpointError


@pytest.fixture
def ckpt(tmp_path, tiny_ckpt_no_tokenizer):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt_no_tokenizer, dst)
    return dst


def _rewrite(path, fn):
    tensors = load_file(str(path / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def _load(path):
    return LLM(str(path), device="cpu", dtype="float32", num_cache_blocks=16)


def test_wrong_shape_names_file_and_tensor(ckpt):
    name = "model.layers.0.self_attn.q_proj.weight"
    _rewrite(ckpt, lambda t: t.__setitem__(name, t[name][:-1]))
    with pytest.raises(CheckpointError, match=rf"model.safetensors.*{name}.*shape"):
        _load(ckpt)


def test_missing_tensor_is_listed(ckpt):
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    _rewrite(ckpt, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=rf"missing.*{name}"):
        _load(ckpt)


def test_unexpected_tensor_is_listed(ckpt):
    _rewrite(ckpt, lambda t: t.__setitem__("model.layers.0.extra.weight", torch.zeros(3)))
    with pytest.raises(CheckpointError, match=r"does not use.*model.layers.0.extra.weight"):
        _load(ckpt)


def test_truncated_file_is_named(ckpt):
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        _load(ckpt)


def test_corrupt_header_is_named(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        _load(ckpt)


def test_sharded_checkpoint_loads_and_missing_shard_is_named(ckpt, tiny_ckpt_no_tokenizer):
    tensors = load_file(str(ckpt / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    parts = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, keys in parts.items():
        save_file({k: tensors[k] for k in keys}, str(ckpt / file))
    (ckpt / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {k: f for f, keys in parts.items() for k in keys}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    ids = {"prompt_token_ids": [4, 8, 15, 16]}
    from dayzero import SamplingParams
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert _load(ckpt).generate([ids], sp)[0].outputs[0].token_ids == _load(tiny_ckpt_no_tokenizer).generate([ids], sp)[0].outputs[0].token_ids
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        _load(ckpt)


def test_unknown_model_type_lists_supported(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "no_such_arch"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"no_such_arch.*dayzero_hybrid"):
        _load(ckpt)


def test_config_that_disagrees_with_weights(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["kv_lora_rank"] = 48
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"self_attn\.kv_a.*has shape.*config.json expects"):
        _load(ckpt)
