"""Rendering a profile (:mod:`dayzero.tools.profile`): tables sorted by cost, and the per-layer plot. A profile
cut short by Ctrl-C shows the phases it measured; the others read "-"."""
from __future__ import annotations

from dayzero.tools import fmt
from dayzero.tools.profile import total


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.3f}"


def render(r: dict, top: int = 16) -> str:
    images = (f" + {r['images']} image{'s' * (r['images'] != 1)} ({r['image_tokens']} tokens)"
              if r.get("images") else "")
    out = [f"profile: {r['model']} on {r['device']} ({r['dtype']}, {r['timer']}): prompt {r['prompt_len']} tokens"
           f"{images} × batch {r['batch']}, {r['steps']} decode steps"]
    if r["interrupted"]:
        out.append(f"  interrupted after {r['rounds_done']} of {r['repeats']} rounds: medians of what was measured"
                   + ("" if len(r["phases"]) == 2 else f"; measured: {', '.join(r['phases'])}"))
    for phase in r["phases"]:
        p = r[phase]
        vision = f", the vision tower's {_ms(p['vision_s'])} ms" if p.get("vision_s") else ""
        out.append(f"  {phase}: step {_ms(p['step_s'])} ms; with layer timers {_ms(p['timed_step_s'])} ms, of which "
                   f"the layers {_ms(p['layers_sum_s'])} ms ({p['coverage'] * 100:.0f}%){vision}")
    out.append("by layer kind:")
    tot = sum(total(k) for k in r["by_kind"]) or 1.0
    out.append(fmt.table([[k["kind"], k["layers"], _ms(k["prefill_s"]), _ms(k["decode_s"]),
                           f"{total(k) / tot * 100:.1f}%"] for k in r["by_kind"]],
                         ["kind", "layers", "prefill ms", "decode ms", "share"]))
    out.append("cost by part, sorted (ms per step, summed over the kind's layers):")
    rows = [(k["kind"], p, v) for k in r["by_kind"] for p, v in k["parts"].items()]
    rows.sort(key=lambda x: -total(x[2]))
    out.append(fmt.table([[k, p, _ms(v["prefill_s"]), _ms(v["decode_s"])] for k, p, v in rows],
                         ["kind", "part", "prefill ms", "decode ms"]))
    out.append(f"layers, sorted by cost (top {min(top, len(r['layers']))}):")
    ls = sorted(r["layers"], key=lambda l: -total(l))[:top]
    out.append(fmt.table([[l["index"], l["kind"], _ms(l["prefill_s"]), _ms(l["decode_s"]), fmt.size(l["weights_bytes"]),
                           fmt.size(l["cache_bytes"]),
                           fmt.size(l["peak_transient_bytes"]) if l["peak_transient_bytes"] is not None else "-"]
                          for l in ls],
                         ["layer", "kind", "prefill ms", "decode ms", "weights", "cache", "peak transient"]))
    if r.get("expert_load"):
        ep = r.get("ep", 1)
        out.append(f"routed load per MoE layer ((token, expert) pairs over the measured steps; by {ep} "
                   f"expert-parallel rank{'s' * (ep != 1)}):")
        out.append(fmt.table([[e["layer"], e["pairs"], e["hottest"], f"{e['imbalance']:.2f}",
                               " / ".join(str(v) for v in e["rank_pairs"]), f"{e['rank_imbalance']:.2f}"]
                              for e in r["expert_load"]],
                             ["layer", "pairs", "hottest expert", "max/mean", "pairs by rank", "rank max/mean"]))
    return "\n".join(out)


def figure(r: dict):
    """Stacked bars per layer and part, one panel per measured phase; each bar's tick names its layer kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = r["phases"]
    parts = sorted({p for l in r["layers"] for ph in phases for p in l[f"{ph}_parts"]})
    colors = {p: plt.get_cmap("tab20")(i % 20) for i, p in enumerate(parts)}
    fig, axes = plt.subplots(len(phases), 1, figsize=(max(11, 0.3 * len(r["layers"]) + 5), 4 * len(phases) + 1.5),
                             sharex=True, squeeze=False)
    x = list(range(len(r["layers"])))  # the vision layers (index "v0", ...) first, then the decoder layers
    for ax, phase in zip(axes[:, 0], phases):
        bottom = [0.0] * len(x)
        for p in parts:
            h = [l[f"{phase}_parts"].get(p, 0.0) * 1e3 for l in r["layers"]]
            ax.bar(x, h, bottom=bottom, color=colors[p], label=p, width=0.8)
            bottom = [b + v for b, v in zip(bottom, h)]
        ax.set_ylim(0, max(bottom, default=0.0) * 1.08 or 1.0)  # headroom over the tallest bar
        ax.set_ylabel(f"{phase} ms / step")
        ax.set_title(f"{phase}: step {r[phase]['step_s'] * 1e3:.2f} ms, layers {r[phase]['layers_sum_s'] * 1e3:.2f} ms")
    last = axes[-1, 0]
    last.set_xticks(x, [f"{l['index']} {l['kind']}" for l in r["layers"]], rotation=90, fontsize="small")
    last.set_xlabel("layer and kind (attention+MLP; vision: the tower's blocks and mergers)"
                    if any(l["kind"] == "vision" for l in r["layers"]) else "layer and kind (attention+MLP)")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize="small", loc="center right")
    cut = " (interrupted)" if r["interrupted"] else ""
    images = f" + {r['images']} image{'s' * (r['images'] != 1)}" if r.get("images") else ""
    fig.suptitle(f"{r['model']} on {r['device']}: prompt {r['prompt_len']}{images} × batch {r['batch']}{cut}")
    fig.tight_layout(rect=(0, 0, 0.8, 1))
    return fig


def plot(r: dict, path: str) -> None:
    import matplotlib.pyplot as plt

    fig = figure(r)
    fig.savefig(path, dpi=110)
    plt.close(fig)
