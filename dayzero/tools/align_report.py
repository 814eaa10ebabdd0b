"""Printing and plotting an :class:`~dayzero.tools.align.AlignResult`."""
from __future__ import annotations

import math
from pathlib import Path

from dayzero.tools.align import AlignResult


def _e(v: float | None) -> str:
    return "-" if v is None else (f"{v:.2e}" if math.isfinite(v) else str(v))


def _layer_list(idx: list) -> str:
    text = ",".join(map(str, idx))
    return text if len(text) <= 16 else f"{len(idx)} layers"


def format_report(r: AlignResult) -> str:
    ref = f"{'transformers' if r.reference == 'hf' else 'dayzero'}, fp32, {r.reference_device}"
    same = "" if r.reference_model == r.model else f" ({r.reference_model})"
    if r.random_weights:
        same += "; a bare config: the same random weights on both sides"
    extra = ", ".join(f"{k}={v}" for k, v in r.precision.items())
    images = f", {sum(r.prompt_images)} images" if r.prompt_images else ""
    lines = [
        f"model     {r.model}",
        f"ours      {r.dtype} on {r.device}" + (f" ({extra})" if extra else ""),
        f"reference {r.reference}: {ref}{same}",
        f"prompts   {len(r.prompt_lengths)} of {', '.join(map(str, r.prompt_lengths))} tokens "
        f"({sum(r.prompt_lengths)} positions{images}); threshold {r.threshold:.1e} relative error",
    ]
    if r.interrupted:
        lines.append(f"interrupted: {len(r.prompt_lengths)} of {r.prompts_planned} prompts compared (both sides "
                     f"finished them)")
    width = max([11] + [len(row.kind) for row in r.vision_rows + r.rows])
    lw = 6 if r.vision_rows else 5  # "merger"
    header = f"{'layer':>{lw}}  {'kind':<{width}} {'rel err':>9} {'max abs':>9} {'cosine':>10} {'growth':>7}  pass"
    if r.vision_rows:
        lines += ["", "vision layers (each block, deep-stack merger and the merger, over the images' patches and "
                      "merged tokens):", header]
        lines += [_row(row, lw, width) for row in r.vision_rows]
        lines += ["", "decoder layers (the residual stream over every prompt token, image tokens included):"]
    else:
        lines.append("")
    lines.append(header)
    lines += [_row(row, lw, width) for row in r.rows]
    lines += ["", f"{'kind':<11} {'layers':<16} {'mean rel':>9} {'max rel':>9} {'growth':>7}"]
    for kind, v in r.by_kind.items():
        growth = "-" if v["growth_gmean"] is None else f"x{v['growth_gmean']:.2f}"
        lines.append(f"{kind:<11} {_layer_list(v['layers']):<16} {_e(v['rel_err_mean']):>9} {_e(v['rel_err_max']):>9} {growth:>7}")
    lines.append("")
    if r.vision_rows:
        if r.vision_first_failing is None:
            lines.append("first vision layer over threshold: none")
        else:
            row = r.vision_rows[r.vision_first_failing]
            lines.append(f"first vision layer over threshold: {row.name} (relative error {_e(row.rel_err)})")
        if r.vision_jump is not None:
            row = r.vision_rows[r.vision_jump]
            lines.append(f"vision error jumps x{row.growth:.1f} at {row.name}")
    if r.first_failing is None:
        lines.append("first layer over threshold: none")
    else:
        row = r.rows[r.first_failing]
        lines.append(f"first layer over threshold: {row.index} ({row.kind}, relative error {_e(row.rel_err)})")
    if r.suggestions:
        why = []
        for i in r.suggestions:
            reasons = (["fails"] if not r.rows[i].passed else []) + ([f"error jumps x{r.rows[i].growth:.1f}"] if i == r.jump_layer else [])
            why.append(f"{i} ({r.rows[i].kind}: {', '.join(reasons)})")
        lines.append("keep in higher precision: " + ", ".join(why))
    else:
        lines.append("keep in higher precision: none needed")
    n = sum(r.prompt_lengths)
    lines.append(f"end to end: top-1 agreement {r.top1:.1%} ({round(r.top1 * n)}/{n}), KL mean {_e(r.kl_mean)} "
                 f"max {_e(r.kl_max)}, logits relative error {_e(r.logits_rel_err)}")
    failed = sum(not row.passed for row in r.rows)
    vision = (f" and {sum(not row.passed for row in r.vision_rows)} of {len(r.vision_rows)} vision layers"
              if r.vision_rows else "")
    lines.append("PASS" if r.passed else f"FAIL: {failed} of {len(r.rows)} layers{vision} over threshold")
    return "\n".join(lines)


def _row(row, lw: int, width: int) -> str:
    growth = "-" if row.growth is None else f"x{row.growth:.1f}"
    note = f"  ({row.note})" if row.note else ""
    return (f"{row.label:>{lw}}  {row.kind:<{width}} {_e(row.rel_err):>9} {_e(row.max_abs):>9} {row.cosine:>10.6f} "
            f"{growth:>7}  {'ok' if row.passed else 'FAIL'}{note}")


def plot(r: AlignResult, path: str | Path) -> None:
    """Relative error by layer (log scale), coloured by layer kind, with the threshold line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    kinds = list(r.by_kind)
    colours = {k: plt.get_cmap("tab10")(i % 10) for i, k in enumerate(kinds)}
    floor = 1e-12  # an exact layer (relative error 0) still gets a point on the log axis
    rows = r.vision_rows + r.rows  # the vision layers first, then the decoder layers
    fig, ax = plt.subplots(figsize=(max(6.0, 0.25 * len(rows) + 3), 4))
    xs = list(range(len(rows)))
    ys = [max(row.rel_err, floor) if math.isfinite(row.rel_err) else float("nan") for row in rows]
    ax.plot(xs, ys, color="0.7", linewidth=1, zorder=1)
    for k in kinds:
        sel = [x for x, row in zip(xs, rows) if row.kind == k]
        ax.scatter(sel, [ys[i] for i in sel], color=colours[k], label=k, zorder=2, s=36)
    bad = [x for x, row in zip(xs, rows) if not row.passed]
    if bad:
        ax.scatter(bad, [ys[i] for i in bad], facecolors="none", edgecolors="red", s=110, linewidths=1.5, zorder=3,
                   label="over threshold")
    ax.axhline(r.threshold, color="red", linestyle="--", linewidth=1, label=f"threshold {r.threshold:.0e}")
    if r.vision_rows:
        ax.axvline(len(r.vision_rows) - 0.5, color="0.5", linestyle=":", linewidth=1)
        ax.set_xticks(xs, [row.label for row in rows], rotation=90, fontsize="small")
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_yscale("log")
    ax.set_xlabel("vision layer, then decoder layer" if r.vision_rows else "layer")
    ax.set_ylabel("relative error of the residual stream")
    ax.set_title(f"{Path(r.model).name}: {r.dtype} vs {r.reference} reference")
    ax.legend(fontsize=8)
    ax.grid(True, which="major", alpha=0.3)
    fig.tight_layout()
    fig.savefig(str(path), dpi=120)
    plt.close(fig)
