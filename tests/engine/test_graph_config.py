"""CUDA-graph settings and their shapes, on any machine: the captured batch sizes and block-table widths, how a
step finds its graph, bad settings named, and the reserved null slot counted in the cache."""
from __future__ import annotations

import pytest
import torch

from dayzero import LLM
from dayzero.engine.cuda_graphs import DecodeGraphs, default_sizes, default_widths
from dayzero.engine.engine import EngineConfig


def test_default_sizes_cover_every_batch_up_to_the_limit():
    assert default_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert default_sizes(1) == [1] and default_sizes(3) == [1, 2, 3] and default_sizes(12) == [1, 2, 4, 8, 12]


def test_default_widths_double_up_to_the_longest_table():
    # 16-token blocks, 256 tokens at least: 16, 32, ... blocks, the last the table of 4096 tokens
    assert default_widths(8192, 16, 4096) == [16, 32, 64, 128, 256]
    assert default_widths(8192, 16, 5000) == [16, 32, 64, 128, 256, 313]  # capped at what 5000 tokens need
    assert default_widths(35, 16, 560) == [16, 32, 35]
    assert default_widths(8, 16, 100) == [7]  # shorter than the smallest width: one capture


def test_lookup_takes_the_next_captured_shape_or_none():
    g = DecodeGraphs(runner=None, sizes=[1, 2, 4, 8], widths=[16, 32, 35], block_size=16)
    assert g.lookup(1, 1) == (1, 16) and g.lookup(3, 17) == (4, 32) and g.lookup(8, 35) == (8, 35)
    assert g.lookup(9, 1) is None and g.lookup(1, 36) is None  # larger than every capture: eager


@pytest.mark.parametrize("field,value", [("cuda_graph_sizes", [0]), ("cuda_graph_sizes", []),
                                         ("cuda_graph_sizes", [1.5]), ("cuda_graph_max_len", 0)])
def test_bad_graph_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_no_graphs_on_a_cpu(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), device="cpu", dtype="float32", num_cache_blocks=32)
    assert llm.engine.runner.graphs is None and "need a CUDA device" in llm.engine.decode_mode
    assert LLM(str(tiny_ckpt), device="cpu", num_cache_blocks=32, enforce_eager=True).engine.decode_mode == "eager"


def test_state_tensors_hold_the_null_slot_besides_the_plans(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), device="cpu", dtype="float32", num_cache_blocks=32, max_num_seqs=3,
              num_prefix_snapshots=2)
    plan = llm.engine.cache_plan
    assert plan.num_snapshots == 2 and plan.state_rows == plan.num_slots + 1 + 2
    states = [t for _, layer in llm.engine.runner.layers for t in layer.cache.values()
              if isinstance(t, torch.Tensor) and t.shape[0] == plan.state_rows]
    assert states and len(states) == len(llm.engine.runner.state_tensors), "state tensors without the null slot"
    slots = llm.engine.cache.slots
    assert slots.num_free == plan.num_slots and 0 not in slots.free  # slot 0 is never handed out
    assert plan.total_bytes == plan.num_blocks * plan.bytes_per_block + (plan.num_slots + 3) * plan.bytes_per_slot
