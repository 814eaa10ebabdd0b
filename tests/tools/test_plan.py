"""dayzero plan: device table, layouts, memory terms against a real allocation, roofline ranking."""
from __future__ import annotations

import json

import pytest
import torch

from dayzero import LLM
from dayzero.cache.planner import auto_block_size, plan_cache
from dayzero.cli import main as cli
from dayzero.engine.model_runner import ModelRunner
from dayzero.models.registry import load_config
from dayzero.tools.devices import DEVICES, parse_device_spec, parse_devices
from dayzero.tools.plan import PlanConfig, memory, plan, predict_allocation
from dayzero.tools.probe import build_uninitialised
from tests.conftest import CONFIGS, tiny_config
from tests.tools.released_configs import RELEASED


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else t.nbytes


def _allocated(model, layers) -> tuple[int, int]:
    weights = sum(_nbytes(p) for p in model.parameters())
    cache = sum(_nbytes(t) for _, layer in layers for t in layer.cache.values())
    return weights, cache


def test_device_table_and_custom_devices():
    assert parse_devices("16xH200") == (16, DEVICES["h200"])
    assert parse_devices("mi300x")[0] == 1
    npu = parse_device_spec("npu:96:1.6:320:200")
    assert parse_devices("4xNPU", [npu]) == (4, npu) and npu.mem_gib == 96 and npu.link_gbps == 200
    with pytest.raises(ValueError, match="unknown device kind"):
        parse_devices("8xTPU9")
    with pytest.raises(ValueError, match="name:mem_gib"):
        parse_device_spec("npu:96")


def test_prediction_matches_a_real_load_of_the_tiny_model(tiny_ckpt_no_tokenizer):
    L, B = 512, 4
    # one snapshot a sequence, as predicted (the default would add spare ones from this roomy budget)
    llm = LLM(str(tiny_ckpt_no_tokenizer), device="cpu", dtype="float32", max_num_seqs=B, max_model_len=L,
              cache_memory_bytes=1 << 40, num_prefix_snapshots=B)
    weights, cache = _allocated(llm.engine.model, llm.engine.runner.layers)
    pred = predict_allocation(str(tiny_ckpt_no_tokenizer), "fp32", L, B)
    assert pred["weights"] == pytest.approx(weights, rel=0.10)
    assert pred["cache"] == pytest.approx(cache, rel=0.10)


def test_prediction_matches_a_real_load_with_mxfp4_experts(tmp_path):
    """Packed MXFP4 experts plus the conversion workspace the engine reserves for the largest layer."""
    from dayzero.tools.build_default_model import build_checkpoint
    from dayzero.tools.quantize import quantize_checkpoint

    src = build_checkpoint(tmp_path / "src", tiny_config(moe_latent_size=64, moe_intermediate_size=32), tokenizer=False)
    dst = tmp_path / "mxfp4"
    quantize_checkpoint(src, dst, "mxfp4", progress=False)
    L, B = 256, 2
    llm = LLM(str(dst), device="cpu", dtype="float32", max_num_seqs=B, max_model_len=L, cache_memory_bytes=1 << 40,
              num_prefix_snapshots=B)  # as predicted
    eng = llm.engine
    weights, cache = _allocated(eng.model, eng.runner.layers)
    pred = predict_allocation(str(dst), "fp32", L, B)
    assert pred["weights"] == pytest.approx(weights + eng.expert_workspace.nbytes, rel=0.10)
    assert pred["cache"] == pytest.approx(cache, rel=0.10)
    assert eng.expert_workspace.nbytes > 0


def test_prediction_matches_the_engine_allocation_of_the_small_model():
    """The 1.9B config: the engine's own model runner and cache planner allocate (pages stay untouched)."""
    L, B = 8192, 8
    path = CONFIGS / "dayzero-small.json"
    spec = load_config(path)
    model = build_uninitialised(spec, torch.bfloat16, "cpu")
    runner = ModelRunner(model, torch.device("cpu"), torch.bfloat16)
    runner.allocate_cache(plan_cache(runner.specs, 16, L, B, 1 << 50))
    weights, cache = _allocated(model, runner.layers)
    pred = predict_allocation(str(path), "bf16", L, B, snapshots=0)  # plan_cache was asked for none
    assert pred["weights"] == pytest.approx(weights, rel=0.10)
    assert pred["cache"] == pytest.approx(cache, rel=0.10)


def test_prediction_matches_the_engine_allocation_of_deepseek_v4():
    """DeepSeek-V4's caches: strided entry pools (one row per 4 or 128 tokens) plus per-sequence rings."""
    L, B = 4096, 4
    path = CONFIGS / "deepseek-v4-small.json"
    model = build_uninitialised(load_config(path), torch.bfloat16, "meta")
    runner = ModelRunner(model, torch.device("meta"), torch.bfloat16)
    bs = auto_block_size(runner.specs)  # what the engine takes: 128, one row per HCA entry
    assert bs == 128
    runner.allocate_cache(plan_cache(runner.specs, bs, L, B, 1 << 50))
    cache = sum(_nbytes(t) for _, layer in runner.layers for t in layer.cache.values())
    pred = predict_allocation(str(path), "bf16", L, B, snapshots=0)
    assert pred["cache"] == pytest.approx(cache, rel=0.10)
    assert pred["weights"] == pytest.approx(sum(_nbytes(p) for p in model.parameters()), rel=0.10)


def test_2p8t_on_h200s_with_mxfp4_experts():
    cfg = PlanConfig(devices=64, device=DEVICES["h200"], context=131072, batch=16, experts="mxfp4")
    p = plan(str(CONFIGS / "dayzero-2.8t.json"), cfg)
    best = p["best"]
    assert best is not None and best["fits"] and best["max_context"] >= 131072
    assert best["decode_tokens_per_s"] > 0 and best["prefill_tokens_per_s"] > 0
    m = best["memory"]
    assert all(m[k] > 0 for k in ("weights", "workspace", "kv_cache", "state", "indexer_scratch", "moe_dispatch"))
    # MXFP4 experts (4.25 bits) take about 4.25/16 of their bf16 bytes
    bf16 = plan(str(CONFIGS / "dayzero-2.8t.json"), PlanConfig(devices=64, device=DEVICES["h200"], context=131072,
                                                                batch=16, experts="bf16"))
    same = next(r for r in bf16["layouts"] if r["name"] == best["name"])
    assert m["weights"] < 0.4 * same["memory"]["weights"]
    assert same["memory"]["workspace"] == 0


def test_auto_conversion_reads_packed_experts_in_decode_and_converts_for_prefill():
    """``--conversion auto`` (the engine's default) holds a bf16 workspace but moves no workspace bytes in a
    decode step (packed experts read by the fused kernels), and a large prefill step converts like ``bf16``."""
    def run(conversion):
        cfg = PlanConfig(devices=1, device=DEVICES["h200"], context=8192, batch=1, conversion=conversion)
        return next(r for r in plan(str(CONFIGS / "dayzero-small-mxfp4.json"), cfg)["layouts"] if r["layout"]["tp"] == 1)

    auto, bf16, fused = run("auto"), run("bf16"), run("fused")
    assert auto["memory"]["workspace"] == bf16["memory"]["workspace"] > 0 == fused["memory"]["workspace"]
    assert auto["decode_tokens_per_s"] == pytest.approx(fused["decode_tokens_per_s"])
    assert auto["decode_tokens_per_s"] > 1.5 * bf16["decode_tokens_per_s"]  # every expert converted each step
    assert auto["prefill_tokens_per_s"] == pytest.approx(bf16["prefill_tokens_per_s"])


def test_fp8_activations_plan_the_fp8_tile_workspace():
    """With FP8 activations the engine converts MXFP4 experts into FP8 tiles (a byte a weight and one fp32 scale
    per 128 x 128 tile), not bf16: the plan's workspace holds about half the bytes, those of ``--conversion fp8``
    less the FP8 workspace's block scales; ``fused`` keeps none either way."""
    def run(conversion, a8):
        cfg = PlanConfig(devices=1, device=DEVICES["h200"], context=8192, batch=1, conversion=conversion,
                         fp8_activations=a8)
        p = plan(str(CONFIGS / "dayzero-small-mxfp4.json"), cfg)
        return next(r for r in p["layouts"] if r["layout"]["tp"] == 1)["memory"]["workspace"], p

    bf16, _ = run("auto", False)
    tiles, p = run("auto", True)
    fp8, _ = run("fp8", False)
    assert tiles == run("fp8", True)[0] and run("fused", True)[0] == 0
    assert 0.49 * bf16 < tiles < 0.51 * bf16 and 1.1 * tiles < fp8 < 1.13 * tiles  # fp32 scales per 32 there
    assert "FP8-tile" in json.dumps(p, default=str)


def test_memory_terms_scale_as_stated():
    from dayzero.tools.model_info import load
    from dayzero.tools.plan import Layout, model_costs

    info = load(str(CONFIGS / "dayzero-2.8t.json"))
    cfg = PlanConfig(devices=16, device=DEVICES["h200"], batch=4)
    costs = model_costs(info)
    lay = Layout(1, 4, 4, 16)
    a, b = memory(costs, cfg, lay, 65536), memory(costs, cfg, lay, 131072)
    assert b["kv_cache"] == pytest.approx(2 * a["kv_cache"]) and b["state"] == a["state"]
    assert b["weights"] == a["weights"]
    # the MLA latent is one row for all heads: tensor parallelism replicates it, data parallelism splits sequences
    tp = memory(costs, cfg, Layout(1, 16, 1, 16), 65536)
    assert tp["kv_cache"] == pytest.approx(4 * a["kv_cache"], rel=0.01)


def test_attention_data_parallel_pays_for_big_mla_batches(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(RELEASED["DeepSeek-V3"][0]))
    big = plan(str(tmp_path), PlanConfig(devices=8, device=DEVICES["h200"], context=32768, batch=64))
    one = plan(str(tmp_path), PlanConfig(devices=8, device=DEVICES["h200"], context=32768, batch=1))
    assert big["best"]["layout"]["dp"] > 1 and one["best"]["layout"]["dp"] == 1


def test_plan_cli(capsys):
    rc = cli(["plan", str(CONFIGS / "dayzero-small.json"), "--devices", "2xnpu", "--device-spec", "npu:32:1.6:300:100",
              "--context", "32768", "--batch", "8"])
    out = capsys.readouterr().out
    assert rc == 0 and "best: pp" in out and "longest context" in out


def test_layouts_the_engine_cannot_run_yet_are_marked(tmp_path, capsys):
    """The plan ranks every layout; a row the engine cannot run says why (attention data parallelism with expert-TP
    groups wider than a replica), and the best layout the engine runs is named beside the plan's
    best. Without dp every ep dividing a stage runs (1 < ep < G: expert TP inside the expert groups)."""
    (tmp_path / "config.json").write_text(json.dumps(RELEASED["DeepSeek-V3"][0]))
    p = plan(str(tmp_path), PlanConfig(devices=8, device=DEVICES["h200"], context=32768, batch=64))
    for r in p["layouts"]:
        lay, g = r["layout"], r["layout"]["tp"] * r["layout"]["dp"]
        runs = g % lay["ep"] == 0 and (lay["dp"] == 1 or lay["ep"] in (1, g) or lay["tp"] % (g // lay["ep"]) == 0)
        assert (r["engine_gap"] is None) == runs, r["name"]
        if not runs:
            assert "data parallelism" in r["engine_gap"]
    run = p["best_runnable"]
    assert run is not None and run["engine_gap"] is None and run["fits"]
    # big MLA batches: the plan's best splits the sequences over dp replicas, the experts over every rank, which runs
    best = p["best"]["layout"]
    assert best["dp"] > 1 and best["pp"] == 1 and best["ep"] == 8 and run["name"] == p["best"]["name"]
    assert cli(["plan", str(tmp_path), "--devices", "8xH200", "--context", "32768", "--batch", "64", "--top", "100"]) == 0
    out = capsys.readouterr().out
    assert "not yet" in out and "the engine cannot run it yet" not in out


def test_sliding_window_layers_cost_their_window_not_the_context(tmp_path):
    """gpt-oss-120b: 18 of 36 layers read a window of 128 keys; their cache is the engine's windowed pool (each
    seat's window and two steps of new tokens), so only the 18 full layers grow with the context."""
    (tmp_path / "config.json").write_text(json.dumps(RELEASED["gpt-oss-120b"][0]))
    cfg = PlanConfig(devices=1, device=DEVICES["h200"], context=131072, batch=4, prefill_chunk=2048)
    row = plan(str(tmp_path), cfg)["layouts"][0]
    per_layer_token = 2 * 8 * 64 * 2  # k and v, 8 kv heads of 64, bf16
    pool_tokens = (4 * (8 + 1 + 2) + 2 * 2048 // 16) * 16  # window_pool_blocks less the null block, in tokens
    want = 18 * per_layer_token * (4 * 131072 + pool_tokens)
    assert row["memory"]["kv_cache"] == pytest.approx(want, rel=1e-6)
    # the longest context of 64 sequences counts only the full layers' growth: about twice what it is when all 36
    # layers grow with it
    cfg = PlanConfig(devices=1, device=DEVICES["h200"], context=8192, batch=64, prefill_chunk=2048)
    windowed = plan(str(tmp_path), cfg)["longest_context"]
    (tmp_path / "config.json").write_text(json.dumps({**RELEASED["gpt-oss-120b"][0], "sliding_window": None}))
    every = plan(str(tmp_path), cfg)["longest_context"]
    assert 8192 < every < 131072 and 1.8 * every < windowed < 2.2 * every
