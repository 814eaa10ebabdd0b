"""dayzero ops and dayzero profile on the tiny model."""
from __future__ import annotations

import json

import pytest
import torch

from dayzero import LLM, SamplingParams
from dayzero.cli import main as cli
from dayzero.ops import registry
from dayzero.tools.ops_table import op_table
from dayzero.tools import profile as P
from dayzero.tools.profile import MOE_PARTS, profile
from tests.conftest import CONFIGS


def test_ops_lists_every_op_the_model_runs(tiny_ckpt):
    called = set()

    def hook(op, chosen, reason, fn, args, kwargs):
        called.add(op)
        return fn(*args, **kwargs)

    llm = LLM(str(tiny_ckpt), device="cpu", dtype="float32", num_cache_blocks=64, max_num_batched_tokens=16)
    prev = registry.set_hook(hook)
    try:  # a long prompt (past the indexer's top-k, in chunks) and decoding
        llm.generate([{"prompt_token_ids": list(range(40))}, "hi"], SamplingParams(max_tokens=4, ignore_eos=True))
    finally:
        registry.set_hook(prev)
    t = op_table(str(tiny_ckpt), "cpu")
    listed = {r["op"] for r in t["ops"]}
    assert called and called <= listed, called - listed
    by_op = {r["op"]: r for r in t["ops"]}
    assert by_op["kda_pooled"]["used_by"] == ["kda"] and by_op["paged_indexer_topk"]["used_by"] == ["dsa"]
    assert {"prefill", "decode"} <= set(by_op["paged_mla"]["phases"])


def test_ops_cli_on_another_platform_names_the_fallbacks(capsys):
    assert cli(["ops", str(CONFIGS / "dayzero-tiny.json"), "--platform", "cuda", "--json"]) == 0
    t = json.loads(capsys.readouterr().out)
    for r in t["ops"]:
        assert set(r["implementation"].split("/")) <= set(r["available"])
        if r["fallback"]:
            assert r["reasons"], r  # why it runs the reference: no implementation, or the verifier's reason
    assert t["fallbacks"] == sum(r["fallback"] for r in t["ops"])


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # steadier timings on a shared machine
    yield
    torch.set_num_threads(n)


def test_profile_layers_account_for_the_step(tiny_ckpt, tmp_path, one_thread, capsys):
    r = profile(str(tiny_ckpt), prompt_len=48, batch=2, steps=4, device="cpu", dtype="float32", repeats=5)
    for phase in ("prefill", "decode"):
        assert r[phase]["coverage"] == pytest.approx(1.0, abs=0.15), (phase, r[phase])
        assert r[phase]["step_s"] > 0
    kinds = {k["kind"]: k for k in r["by_kind"]}
    assert set(kinds) == {"kda+dense", "dsa+moe", "kda+moe", "gqa+moe"}
    assert kinds["kda+moe"]["parts"]["state update"]["prefill_s"] > 0
    assert kinds["dsa+moe"]["parts"]["attention"]["decode_s"] > 0
    assert set(MOE_PARTS) <= set(kinds["gqa+moe"]["parts"])
    assert kinds["gqa+moe"]["parts"]["MoE expert compute"]["decode_s"] > 0
    assert kinds["gqa+moe"]["parts"]["MoE routing"]["decode_s"] > 0  # the router, inside moe_experts_routed
    # a projection is counted once, under projections, whether a module or the linear ops ran it
    assert all("projections" in k["parts"] and not any("linear" in p for p in k["parts"]) for k in kinds.values())
    assert all(l["weights_bytes"] > 0 and l["cache_bytes"] > 0 for l in r["layers"])
    # every token the steps ran went through every MoE layer: top-k pairs each
    moe = {i for i, l in enumerate(r["layers"]) if l["kind"].endswith("+moe")}
    loads = r["expert_load"]
    assert {e["layer"] for e in loads} == moe and len({e["pairs"] for e in loads}) == 1 and loads[0]["pairs"] > 0
    assert all(sum(e["per_expert"]) == e["pairs"] == sum(e["rank_pairs"]) and e["imbalance"] >= 1 for e in loads)
    png = tmp_path / "p.png"
    capsys.readouterr()
    assert cli(["profile", str(CONFIGS / "dayzero-tiny.json"), "--prompt-len", "40", "--steps", "2", "--repeats", "1",
                "--device", "cpu", "--plot", str(png), "--ep", "2"]) == 0
    assert png.stat().st_size > 10_000
    table = capsys.readouterr().out.split("routed load per MoE layer")[1]
    assert "by 2 expert-parallel ranks" in table and "pairs by rank" in table


def test_a_container_ops_inner_ops_keep_their_parts(monkeypatch):
    """Inside a container op (moe_experts_routed) each op it calls is timed as its own part (renamed where the
    container says: its router GEMV as MoE routing), the rest of its time as its part, and the pieces do not
    overlap; ops deeper down stay in the op that called them."""
    import time

    calls = []

    @registry.register("test_inner_linear")
    def inner_linear(x):
        time.sleep(0.002)
        return registry.call("test_deeper", x)

    @registry.register("test_deeper")
    def deeper(x):
        calls.append("deeper")
        return x

    @registry.register("test_route_experts")
    def container(x):
        time.sleep(0.002)
        x = registry.call("test_inner_linear", x)
        time.sleep(0.002)
        return registry.call("moe_permute", torch.zeros(1, 1, dtype=torch.long), 2)

    monkeypatch.setattr(P, "CONTAINERS", {"test_route_experts": {"test_inner_linear": "MoE routing"}})
    prof = P.Profiler.__new__(P.Profiler)
    prof.layers, prof.model, prof.clock = [], torch.nn.Linear(1, 1), P._Clock(torch.device("cpu"))
    prof.records, prof._layer, prof._depth, prof._open = [], 3, 0, None
    handles = prof._install(ops=True)
    try:
        registry.call("test_route_experts", torch.zeros(1))
    finally:
        for h in handles:
            h.remove()
        for op in ("test_inner_linear", "test_deeper", "test_route_experts"):
            registry._OPS.pop(op)
    parts = [(layer, part) for layer, part, _, _ in prof.records]
    assert parts == [(3, "test_route_experts"), (3, "MoE routing"), (3, "test_route_experts"), (3, "MoE dispatch"),
                     (3, "test_route_experts")]
    ends = [(a, b) for _, _, a, b in prof.records]
    assert all(a <= b for a, b in ends) and all(b0 <= a1 for (_, b0), (a1, _) in zip(ends, ends[1:]))
    assert calls == ["deeper"] and prof._depth == 0 and prof._open is None
    assert ends[1][1] - ends[1][0] >= 0.002  # the inner op's time, its deeper op inside
