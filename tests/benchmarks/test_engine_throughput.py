"""benchmarks/engine_throughput.py's roofline arithmetic: a decode step's weight bytes count the routed experts a
batch hits, in their stored format (packed MXFP4 at 4.25 bits a weight)."""
from __future__ import annotations

import pytest
import torch

from benchmarks.engine_throughput import IDLE_WARNING, active_params, busy_line, timeline, weight_bytes
from dayzero.models.registry import load_config
from dayzero.tools.probe import build_uninitialised


def _model(config: str):
    spec = load_config(config)
    return build_uninitialised(spec, torch.bfloat16, "meta"), spec


def test_weight_bytes_count_the_experts_a_batch_hits_as_stored():
    dense, spec = _model("configs/dayzero-small.json")
    packed, spec_mx = _model("configs/dayzero-small-mxfp4.json")
    moe = [ls.mlp for ls in spec.layers if hasattr(ls.mlp, "n_experts")]
    E, k, n_moe = moe[0].n_experts, moe[0].top_k, len(moe)
    routed = n_moe * E * 3 * moe[0].latent_size * moe[0].intermediate_size  # gate, up and down of every expert
    hit = lambda b: 1 - (1 - k / E) ** b  # noqa: E731
    # the bf16 model: the gap between batch 32 and batch 1 is the routed experts newly hit, 2 bytes a weight
    assert weight_bytes(dense, spec, 32) - weight_bytes(dense, spec, 1) == pytest.approx(2 * routed * (hit(32) - hit(1)))
    # packed: 17 bytes per 32 weights (16 of codes, one scale), the same share hit
    gap = weight_bytes(packed, spec_mx, 32) - weight_bytes(packed, spec_mx, 1)
    assert gap == pytest.approx(routed * 17 / 32 * (hit(32) - hit(1)))
    # the rest (attention, shared experts, norms, the head) is the same in both
    rest = weight_bytes(dense, spec, 1) - 2 * routed * hit(1)
    assert weight_bytes(packed, spec_mx, 1) - routed * 17 / 32 * hit(1) == pytest.approx(rest)
    # parameters count packed experts by their weights, so both checkpoints have the same
    assert active_params(packed, spec_mx) == active_params(dense, spec)


def test_the_step_timeline_counts_overlapping_kernels_once():
    """Under programmatic dependent launch a kernel's span starts before the one before it ends: each kernel is
    credited with what it adds past the latest end before it, so the added times sum to the step's span."""
    ks = [(0.0, 4.0, "norm"), (2.0, 10.0, "linear"), (3.0, 9.0, "early"), (12.0, 15.0, "linear")]
    text = timeline(ks)
    rows = [line.split() for line in text.splitlines()[2:6]]
    assert [float(r[3]) for r in rows] == [4.0, 6.0, 0.0, 5.0]  # "early" ends inside "linear": adds nothing
    assert [float(r[2]) for r in rows] == [0.0, -2.0, -7.0, 3.0]
    summary = text.split("time added to the step by kernel (15.0 us in all):")[1].splitlines()
    assert summary[2].split()[:4] == ["11.0", "73.3%", "2", "5.50"] and summary[2].endswith("linear")


def test_the_side_by_side_flags_a_side_whose_gpu_waits_on_its_host():
    side = lambda f, k: {"batch": 1, "busy_fraction": f, "kernels_per_step": k, "step_ms": 1.5}  # noqa: E731
    calm = busy_line(side(0.82, 287), side(0.81, 275))
    assert "82.0% -> 81.0%" in calm and "287 -> 275" in calm and "host" not in calm
    flagged = busy_line(side(0.9, 287), side(IDLE_WARNING - 0.2, 275))
    assert "this version busy less than" in flagged and "baseline" not in flagged.split(";")[1]


def test_weight_bytes_leave_out_the_indexers_query_where_every_key_is_selected():
    """At a context of at most topk tokens a DSA indexer selects every key: its query (768 -> 32 x 128, bf16) and
    head-weight (2048 -> 32, fp32) projections are not read, in each of dayzero-small's 6 DSA layers; past topk they
    are."""
    dense, spec = _model("configs/dayzero-small.json")
    query = 6 * (768 * 32 * 128 * 2 + 2048 * 32 * 4)
    assert weight_bytes(dense, spec, 1) - weight_bytes(dense, spec, 1, context=2048) == query
    assert weight_bytes(dense, spec, 1, context=2049) == weight_bytes(dense, spec, 1)
