"""Rendering a profile (:mod:`dayzero.tools.profile`): tables sorted by cost, and the per-layer plot."""
from __future__ import annotations

from dayzero.tools import fmt


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f}"


def render(r: dict, top: int = 16) -> str:
    out = [f"profile: {r['model']} on {r['device']} ({r['dtype']}, {r['timer']}): prompt {r['prompt_len']} tokens × "
           f"batch {r['batch']}, {r['steps']} decode steps"]
    for phase in ("prefill", "decode"):
        p = r[phase]
        out.append(f"  {phase}: step {_ms(p['step_s'])} ms; with layer timers {_ms(p['timed_step_s'])} ms, of which "
                   f"the layers {_ms(p['layers_sum_s'])} ms ({p['coverage'] * 100:.0f}%)")
    out.append("by layer kind:")
    tot = sum(k["prefill_s"] + k["decode_s"] for k in r["by_kind"]) or 1.0
    out.append(fmt.table([[k["kind"], k["layers"], _ms(k["prefill_s"]), _ms(k["decode_s"]),
                           f"{(k['prefill_s'] + k['decode_s']) / tot * 100:.1f}%"] for k in r["by_kind"]],
                         ["kind", "layers", "prefill ms", "decode ms", "share"]))
    out.append("cost by part, sorted (ms per step, summed over the kind's layers):")
    rows = [(k["kind"], p, v["prefill_s"], v["decode_s"]) for k in r["by_kind"] for p, v in k["parts"].items()]
    rows.sort(key=lambda x: -(x[2] + x[3]))
    out.append(fmt.table([[k, p, _ms(a), _ms(b)] for k, p, a, b in rows], ["kind", "part", "prefill ms", "decode ms"]))
    out.append(f"layers, sorted by cost (top {min(top, len(r['layers']))}):")
    ls = sorted(r["layers"], key=lambda l: -(l["prefill_s"] + l["decode_s"]))[:top]
    out.append(fmt.table([[l["index"], l["kind"], _ms(l["prefill_s"]), _ms(l["decode_s"]), fmt.size(l["weights_bytes"]),
                           fmt.size(l["cache_bytes"]),
                           fmt.size(l["peak_transient_bytes"]) if l["peak_transient_bytes"] is not None else "-"]
                          for l in ls],
                         ["layer", "kind", "prefill ms", "decode ms", "weights", "cache", "peak transient"]))
    return "\n".join(out)


def plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = sorted({p for l in r["layers"] for ph in ("prefill", "decode") for p in l[f"{ph}_parts"]})
    colors = {p: plt.get_cmap("tab20")(i % 20) for i, p in enumerate(parts)}
    fig, axes = plt.subplots(2, 1, figsize=(max(11, 0.3 * len(r["layers"]) + 5), 8), sharex=True)
    x = [l["index"] for l in r["layers"]]
    for ax, phase in zip(axes, ("prefill", "decode")):
        bottom = [0.0] * len(x)
        for p in parts:
            h = [l[f"{phase}_parts"].get(p, 0.0) * 1e3 for l in r["layers"]]
            ax.bar(x, h, bottom=bottom, color=colors[p], label=p, width=0.8)
            bottom = [b + v for b, v in zip(bottom, h)]
        ax.set_ylabel(f"{phase} ms / step")
        ax.set_title(f"{phase}: step {r[phase]['step_s'] * 1e3:.2f} ms, layers {r[phase]['layers_sum_s'] * 1e3:.2f} ms")
    axes[1].set_xlabel("layer (" + ", ".join(sorted({l['kind'] for l in r['layers']})) + ")")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize="small", loc="center right")
    fig.suptitle(f"{r['model']} on {r['device']}: prompt {r['prompt_len']} × batch {r['batch']}")
    fig.tight_layout(rect=(0, 0, 0.8, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
