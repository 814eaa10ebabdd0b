"""``dayzero ops MODEL --platform cuda``: the operator mapping table.

Every op the model calls is found by running it, not by a list kept by hand: the model's probe (one layer
of each kind at full attention size, see :mod:`dayzero.tools.probe`) runs a prefill and a decode step (one
sequence past every top-k and window) with a hook on the ops registry. For each op: the layers that call
it, the steps it runs in, the implementation the registry picks on the platform for the shapes it was
called with, and, when that is the reference, why (no implementation for the platform, or the verifier's
reason).
"""
from __future__ import annotations

import contextlib

import json
from collections import defaultdict

import torch

from dayzero import ops
from dayzero.ops import registry
from dayzero.tools import fmt
from dayzero.ops.triton_support import judged_as
from dayzero.tools.model_info import load
from dayzero.tools.probe import probe_spec, run_probe
from dayzero.tools.progress import note as progress_note


def _reason(op: str, platform: str, args, kwargs) -> tuple[str, str | None]:
    judge = judged_as(platform) if platform == "cuda" else contextlib.nullcontext()  # CPU tensors stand for GPU ones
    try:
        with judge:
            chosen, _, reason = registry.choose(op, platform, *args, **kwargs)
    except Exception as e:  # a verifier that cannot read the probe's arguments
        return registry.REFERENCE, f"verifier failed: {e}"
    return chosen, reason


def probe_device(platform: str) -> tuple[str, str]:
    """Where the probe runs for ``platform``, and a note when that is not the platform's own device."""
    if platform == "cuda" and not torch.cuda.is_available():
        return "cpu", ("the probe runs on the CPU because no GPU is present: the choices are the registry's for "
                       "cuda, from shapes checked on CPU tensors")
    return ("cuda" if platform == "cuda" else "cpu"), ""


def check_platform(platform: str) -> None:
    known = sorted({p for e in registry.registered().values() for p in e.impls} | {"cpu", "cuda"})
    if platform not in known:
        raise ValueError(f"unknown platform {platform!r} for --platform; registered platforms: {', '.join(known)}")


def op_table(model: str | None = None, platform: str = "cpu", progress: bool = False) -> dict:
    check_platform(platform)
    info = load(model)
    spec = info.spec
    device, note = probe_device(platform)
    dtype = torch.bfloat16 if platform != "cpu" else torch.float32
    seen: dict[str, dict] = {}
    state = {"phase": "", "layer": None}

    def hook(op, chosen, reason, fn, args, kwargs):
        row = seen.get(op)
        if row is None:
            row = seen[op] = {"op": op, "layers": set(), "phases": set(), "calls": 0, "choices": defaultdict(set),
                              "by_phase": defaultdict(set)}
        row["calls"] += 1
        row["phases"].add(state["phase"])
        if state["layer"] is not None:
            row["layers"].add(state["layer"])
        impl, why = _reason(op, platform, args, kwargs)
        row["choices"][impl].add(why or "")
        row["by_phase"][state["phase"]].add(impl)
        return fn(*args, **kwargs)

    def on_phase(name):
        state["phase"] = name
        if progress:
            progress_note(f"ops: {name} step of the probe")

    def on_model(model):  # attribute op calls to layers
        for i, layer in enumerate(model.model.layers):
            layer.register_forward_pre_hook(lambda m, a, i=i: state.__setitem__("layer", i))
            layer.register_forward_hook(lambda m, a, o: state.__setitem__("layer", None))

    if progress:
        progress_note(f"ops: building the probe of {info.name} ({len(probe_spec(spec)[0].layers)} layers standing for "
                      f"{spec.num_hidden_layers}) on {device}")
    prev = registry.set_hook(hook)
    try:
        _, stands_for = run_probe(spec, dtype, device, on_phase, on_model)
    finally:
        registry.set_hook(prev)

    kinds = [l.attn_kind or l.mlp_kind or "-" for l in spec.layers]
    rows = []
    for op, r in sorted(seen.items()):
        layers = sorted({i for p in r["layers"] for i in stands_for[p]})
        used_by = sorted({kinds[i] for i in layers}) if layers else ["model (outside layers)"]
        chosen = sorted(r["choices"])
        reasons = sorted({w for c in chosen for w in r["choices"][c] if w})
        entry = registry.registered()[op]
        rows.append({
            "op": op, "used_by": used_by, "layers": len(layers), "phases": sorted(r["phases"]), "calls": r["calls"],
            "implementation": chosen[0] if len(chosen) == 1 else "/".join(chosen), "available": sorted(entry.impls),
            "by_phase": {p: "/".join(sorted(v)) for p, v in sorted(r["by_phase"].items())},
            "fallback": registry.REFERENCE in chosen and platform != registry.REFERENCE, "reasons": reasons,
        })
    unused = sorted(set(ops.registered()) - set(seen))
    return {"model": info.name, "platform": platform, "probe_device": device, "probe_note": note,
            "probe_dtype": str(dtype).removeprefix("torch."),
            "ops": rows, "fallbacks": sum(r["fallback"] for r in rows), "registered_unused": unused}


def _chosen(r: dict) -> str:
    """The implementation, or per step kind when it differs (a device decode path, the reference for prefill)."""
    if len(set(r["by_phase"].values())) <= 1:
        return r["implementation"]
    return ", ".join(f"{impl} ({phase})" for phase, impl in r["by_phase"].items())


def render(t: dict) -> str:
    out = [f"ops of {t['model']} on {t['platform']} (found by running a probe of the model on {t['probe_device']}, "
           f"{t['probe_dtype']}):"]
    if t["probe_note"]:
        out.append(f"  note: {t['probe_note']}")
    rows = [[r["op"], ",".join(r["used_by"]), " + ".join(r["phases"]), _chosen(r),
             ",".join(r["available"]), "yes" if r["fallback"] else "no", "; ".join(r["reasons"]) or "-"]
            for r in t["ops"]]
    out.append(fmt.table(rows, ["op", "used by", "steps", "chosen", "available", "fallback", "why"]))
    out.append(f"{len(t['ops'])} ops; {t['fallbacks']} run the reference on {t['platform']}")
    if t["registered_unused"]:
        out.append(f"registered but not used by this model: {', '.join(t['registered_unused'])}")
    return "\n".join(out)


def main(args) -> int:
    from dayzero.engine.device import configure_threads

    configure_threads(args.num_threads)
    t = op_table(args.model, args.platform, progress=True)
    print(json.dumps(t, indent=1) if args.json else render(t))
    return 0
