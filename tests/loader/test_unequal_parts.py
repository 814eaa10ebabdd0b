"""A parameter sharded into unequal parts (Gated DeltaNet's [q | k | v | z], Mamba-2's [z | x | B | C | dt]) loads
the rank's rows of each part, read piece by piece from the file (never the whole tensor), with a bias cut alike;
a stored tensor that is not those parts is reported, not loaded; Qwen3-Next's projections grouped per key head are
read as the rank's run of groups."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import dayzero.loader.safetensors_loader as L
from dayzero.layers.parallel import Shard
from dayzero.loader.rules import identity_rules
from dayzero.loader.safetensors_loader import CheckpointError

WIDTHS = (4, 4, 6, 6)


def projection(rank: int) -> nn.Module:
    m = nn.Module()
    m.proj = nn.Linear(3, sum(WIDTHS) // 2)
    cut = Shard(0, rank, 2, widths=WIDTHS)
    m.proj.shards = {"weight": cut, "bias": cut}
    return m


def record_whole_reads(monkeypatch) -> list[str]:
    """The names of the tensors the loader reads whole (``get_tensor``) from now on."""
    whole_reads = []
    real = L.safe_open

    class Recording:
        def __init__(self, *a, **k):
            self.inner = real(*a, **k)

        def get_tensor(self, name):
            whole_reads.append(name)
            return self.inner.get_tensor(name)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    monkeypatch.setattr(L, "safe_open", Recording)
    return whole_reads


def test_each_rank_reads_its_rows_of_each_part(tmp_path, monkeypatch):
    full = {"proj.weight": torch.arange(20 * 3, dtype=torch.float32).view(20, 3), "proj.bias": torch.arange(20.0)}
    save_file(full, str(tmp_path / "model.safetensors"))
    whole_reads = record_whole_reads(monkeypatch)
    for rank, rows in ((0, [0, 1, 4, 5, 8, 9, 10, 14, 15, 16]), (1, [2, 3, 6, 7, 11, 12, 13, 17, 18, 19])):
        m = projection(rank)
        L.load_weights(m, str(tmp_path), identity_rules())
        assert torch.equal(m.proj.weight.data, full["proj.weight"][rows])
        assert torch.equal(m.proj.bias.data, full["proj.bias"][rows])
    assert whole_reads == []


def test_a_tensor_that_is_not_the_parts_is_reported(tmp_path):
    save_file({"proj.weight": torch.zeros(22, 3), "proj.bias": torch.zeros(22)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"is not the 20 rows of parts \(4, 4, 6, 6\)"):
        L.load_weights(projection(0), str(tmp_path), identity_rules())


def test_a_rank_reads_only_its_key_heads_of_the_grouped_gated_deltanet_projections(tmp_path, monkeypatch):
    """Qwen3-Next stores in_proj_qkvz and in_proj_ba grouped per key head: a tp rank reads its run of groups
    (never the whole tensor) and holds what the whole tensor, reordered and cut, would give it."""
    from dayzero.models.registry import adapter_for, build_model, load_config, read_config
    from dayzero.distributed import ParallelState
    from tests.distributed.test_tp_mixers import HF
    from tests.hf.harness import make_hf_checkpoint

    path = tmp_path / "qwen3_next"
    cfg, seed, init = HF["qwen3_next"]
    make_hf_checkpoint(path, "qwen3_next", seed=seed, init=init, **cfg)
    spec = load_config(path)
    raw, cfg_file = read_config(path)
    adapter = adapter_for(raw, cfg_file)
    one = build_model(spec, torch.float32, "cpu")
    L.load_weights(one, path, adapter.rules(spec), adapter.ignore)
    grouped = ("in_proj_qkvz", "in_proj_ba")
    whole_reads = record_whole_reads(monkeypatch)
    full = dict(one.named_parameters())
    for rank in (0, 1):
        model = build_model(spec, torch.float32, "cpu", ParallelState(rank, 2))
        L.load_weights(model, path, adapter.rules(spec), adapter.ignore)
        for name, p in model.named_parameters():
            if name.rsplit(".", 2)[-2] in grouped:
                cut = model.get_submodule(name.rsplit(".", 1)[0]).shards["weight"]
                want = torch.cat([full[name].narrow(0, o + rank * w // 2, w // 2)
                                  for o, w in _parts(cut, full[name].shape[0])])
                assert torch.equal(p, want), name
    assert whole_reads and not [n for n in whole_reads if any(g in n for g in grouped)]


def _parts(shard, n):
    """(start, width) of each part of a full tensor of n rows that a shard cuts."""
    widths = shard.widths or (n // shard.parts,) * shard.parts
    return [(sum(widths[:j]), w) for j, w in enumerate(widths)]
