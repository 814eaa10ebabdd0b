"""Programmatic dependent launch: every kernel launched with ``pdl``'s options waits for the kernel before it first
(checked in the source, here and in CI), and on a Hopper GPU a chain of dependent kernels gives exactly the
values it gives without it, eager and replayed from a CUDA graph."""
from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import dayzero
from dayzero.ops import triton_support
from dayzero.ops.static import mark_static, preload

pytest.importorskip("triton")

PACKAGE = pathlib.Path(dayzero.__file__).parent
READS = ("tl.load", "tl.store", "tl.atomic", "return")
# index arithmetic (n.to: a cast), the weight tile, kda_decode's carried state (its layer's state and conv
# windows, which no kernel but itself writes, at the slot the step's inputs give), and the routed experts' routing
# of logits written two kernels or more before (under EARLY: the kernel before starts this one only after its own
# wait) with their experts' weight tiles (under PRELOAD), kda_decode's arrival at its head's counter (its own), and
# MLA's split kernel's first tile of keys and W_UK's product of q_nope (latent rows, tables, selection, q_nope: its
# caller puts them two kernels or more back, under EARLY)
EARLY = {"tl.program_id", "tl.arange", "n.to", "weight_tile", "carried_state", "route_pair", "expert_weight_tile",
         "route_slots", "head_arrival", "tl.num_programs", "first_keys", "early_rows"}


def _jit_kernels(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
            yield node


def test_every_launched_kernel_waits_for_the_one_before_first():
    launched = 0
    for path in PACKAGE.rglob("*.py"):
        src = path.read_text()
        tree = ast.parse(src)
        launches = [c for c in ast.walk(tree) if isinstance(c, ast.Call) and isinstance(c.func, ast.Subscript)]
        kernels = {k.name: k for k in _jit_kernels(tree)}
        if path.name == "triton_moe.py":  # its kernels live in triton_moe_kernels.py
            kernels = {k.name: k for k in _jit_kernels(ast.parse((path.parent / "triton_moe_kernels.py").read_text()))}
        # kernels launched with pdl()'s options, and any launched kernel taking PDL (whose launch may pass the
        # options through another name: preload(), a variable)
        names = {ast.unparse(c.func.value).split(".")[-1] for c in launches
                 if any(isinstance(k.value, ast.Call) and ast.unparse(k.value.func) == "pdl" for k in c.keywords
                        if k.arg is None)}
        names |= {n for c in launches if (n := ast.unparse(c.func.value).split(".")[-1]) in kernels
                  and "PDL" in [a.arg for a in kernels[n].args.args]}
        for name in names:
            launched += 1
            fn = kernels[name]
            assert "PDL" in [a.arg for a in fn.args.args], f"{path.name}: {name} takes no PDL constexpr"
            body = [ast.unparse(s) for s in fn.body]
            waits = [i for i, s in enumerate(body) if s == "grid_dependency(PDL)"]
            assert waits, f"{path.name}: {name} never calls grid_dependency(PDL)"
            before = "\n".join(body[:waits[0]])
            assert not any(r in before for r in READS), \
                f"{path.name}: {name} reads, writes or returns before grid_dependency(PDL)"
            # the one read allowed before the wait: a weight tile, under the PRELOAD flag (a weight no kernel of
            # the step writes), through the helper that does nothing else
            calls = {ast.unparse(c.func) for s in fn.body[:waits[0]] for c in ast.walk(s) if isinstance(c, ast.Call)}
            assert calls <= EARLY, f"{path.name}: {name} calls {sorted(calls - EARLY)} before grid_dependency(PDL)"
            for s in fn.body[:waits[0]]:
                if "weight_tile" in ast.unparse(s):
                    assert isinstance(s, ast.If) and ast.unparse(s.test) == "PRELOAD", \
                        f"{path.name}: {name} reads a weight before the wait without the PRELOAD flag"
                if any(f in ast.unparse(s) for f in ("route_pair", "route_slots", "first_keys", "early_rows")):
                    assert isinstance(s, ast.If) and ast.unparse(s.test) == "EARLY", \
                        f"{path.name}: {name} routes or reads keys before the wait without the EARLY flag"
            # a wait under a condition could be skipped by some programs
            assert all(isinstance(s, (ast.Expr, ast.Assign, ast.If)) for s in fn.body[:waits[0]])
    assert launched >= 20  # every kernel of the package, not a few found by accident


def test_no_pdl_off_the_gpu(monkeypatch):
    assert triton_support.pdl(torch.zeros(1)) == {"PDL": False}
    monkeypatch.setenv("DAYZERO_PDL", "0")
    assert triton_support.pdl(torch.zeros(1)) == {"PDL": False}


hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                            reason="needs a CUDA device of compute capability 9.0 or more")


def _chain(x, w1, w2, g):
    """A slow producer (a 128 MB weight read) whose output the next kernels read at once, four kernels deep."""
    from dayzero.ops.linear.kernels import skinny_linear
    from dayzero.ops.norm.kernels import rms_norm
    from dayzero.ops.sampling.kernels import greedy_sample_triton

    h = skinny_linear(x, w1, block=(4, 512, 4))
    y, r = rms_norm(h, g, 1e-6, residual=h)
    z = skinny_linear(y, w2, block=(8, 1024, 4), add=r[:, :w2.shape[0]])
    ids, _ = greedy_sample_triton(z)
    return h, y, r, z, ids


@hopper
def test_a_dependent_chain_is_unchanged_by_pdl_eager_and_in_a_graph(monkeypatch):
    gen = torch.Generator(device="cuda").manual_seed(0)
    w1 = mark_static(torch.randn(16384, 4096, device="cuda", generator=gen).bfloat16())  # read before the wait
    w2 = mark_static(torch.randn(4096, 16384, device="cuda", generator=gen).bfloat16() / 64)
    g = torch.rand(16384, device="cuda", generator=gen).bfloat16()
    xs = [torch.randn(3, 4096, device="cuda", generator=gen).bfloat16() for _ in range(6)]
    monkeypatch.setenv("DAYZERO_PDL", "0")
    assert triton_support.pdl(w1) == {"PDL": False}
    want = [_chain(x, w1, w2, g) for x in xs]
    monkeypatch.setenv("DAYZERO_PDL", "1")
    assert triton_support.pdl(w1)["PDL"] and preload(w1, w1)["PRELOAD"]
    for x, ref in zip(xs, want):
        for a, b in zip(_chain(x, w1, w2, g), ref):
            assert torch.equal(a, b)
    x_in = xs[0].clone()
    _chain(x_in, w1, w2, g)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(x_in, w1, w2, g)
    for _ in range(3):
        for x, ref in zip(xs, want):
            x_in.copy_(x)
            graph.replay()
            torch.cuda.synchronize()
            for a, b in zip(out, ref):
                assert torch.equal(a, b)
