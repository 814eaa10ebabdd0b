"""Which layers answer a recall prompt: the attention layers' weights at the answer's first position, and the
answer with their outputs zeroed.

A recall prompt (:func:`dayzero.eval.tasks.recall`) holds key-value pairs in filler text and ends by asking for
one. Through the training forward (the engine's prefill math, :mod:`dayzero.train.forward`) the probe records,
for every attention layer and head, where the last position's attention weight goes: the asked pair, the other
pairs, the filler, the question. It then runs the prompt again with every attention layer's output zeroed over
the question's rows, from ``\\nWhat`` on. If the first digit of the answer survives that, the attention layers do
not retrieve it: the recurrent (KDA) layers' state does, and that state fades as filler grows.

    python scripts/recall_probe.py MODEL --contexts 256 1024 2048 --n 20 [--plot FILE]
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from dayzero.eval.tasks import instances
from dayzero.train.attention import probing
from dayzero.train.batch import TrainBatch
from dayzero.train.forward import logits_of, training

PARTS = ("asked", "others", "filler", "question")


@dataclass
class RecallProbe:
    """One context length's probe over ``n`` prompts."""
    context_len: int
    n: int
    first_right: int  # the answer's first token is the argmax at the last position
    first_right_ablated: int  # the same with every attention layer's output zeroed over the question
    # per attention layer (in model order): [heads, 4] mean attention weight of the last position on PARTS
    mass: list[torch.Tensor] = field(default_factory=list)


def spans(prompt: str, answer: str, style: str) -> tuple[tuple[int, int], list[tuple[int, int]], int]:
    """Character spans of the asked pair and the other pairs, and where the question starts."""
    question = prompt.rfind("\nWhat")
    head = prompt[:question]
    key = re.fullmatch(r"(?s).*\nWhat is ([A-Za-z]+)\? .*", prompt).group(1) if style != "sentence" else None
    if style == "sentence":
        pairs = [m.span() for m in re.finditer(r"The value of [a-z]{4} is \d{4}\.", head)]
        asked = re.search(rf"The value of [a-z]{{4}} is {answer}\.", head).span()
    else:
        sep = "" if style == "joined" else "="
        pairs = [m.span() for m in re.finditer(rf"(?<![A-Za-z])[A-Za-z]+{sep}\d{{4}}\.", head)]
        asked = re.search(rf"(?<![A-Za-z]){key}{sep}{answer}\.", head).span()
    return asked, [p for p in pairs if p != asked], question


def _labels(offsets: list[tuple[int, int]], asked, others, question: int) -> torch.Tensor:
    """Each token's part (an index into PARTS) from its character offsets."""
    out = torch.full((len(offsets),), PARTS.index("filler"), dtype=torch.long)
    for i, (a, _) in enumerate(offsets):
        if a >= question:
            out[i] = PARTS.index("question")
        elif asked[0] <= a < asked[1]:
            out[i] = PARTS.index("asked")
        elif any(s <= a < e for s, e in others):
            out[i] = PARTS.index("others")
    return out


def _last_row_weights(q: torch.Tensor, k: torch.Tensor, scale: float, mask) -> torch.Tensor:
    """q [1, L, H, D], k [1, L, Hkv, D] -> the last row's attention weights [H, L] (fp32)."""
    H, Hkv = q.shape[2], k.shape[2]
    kk = k[0].float().repeat_interleave(H // Hkv, 1)  # [L, H, D]
    s = torch.einsum("hd,lhd->hl", q[0, -1].float(), kk) * scale
    if mask is not None:
        s = s.masked_fill(~mask[0, -1][None], float("-inf"))
    return s.softmax(-1)


@torch.no_grad()
def probe_recall(model, tokenizer, context_len: int, n: int = 20, style: str = "letter", seed: int = 0,
                 sparse: bool = False) -> RecallProbe:
    """Probe ``n`` held-out recall prompts of ``context_len`` tokens (the eval split, as ``dayzero eval`` draws
    them). ``sparse``: the DSA layers attend over their indexers' top-k, as the engine does past it; by default
    densely, so the weights show what the attention would pick with every key in view."""
    count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    insts = instances("recall", n, "eval", seed, context_len=context_len, count=count, style=style)
    device = next(model.parameters()).device
    result = RecallProbe(context_len, n, 0, 0)
    sums: list[torch.Tensor] = []
    for inst in insts:
        enc = tokenizer(inst.prompt, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        asked, others, question = spans(inst.prompt, inst.answer, style)
        labels = _labels(offsets, asked, others, question).to(device)
        first = tokenizer.encode(inst.answer, add_special_tokens=False)[0]
        q_row = next(i for i, (a, _) in enumerate(offsets) if a >= question)
        weights: list[torch.Tensor] = []

        def record(q, k, scale, mask, out):
            weights.append(_last_row_weights(q, k, scale, mask))

        def zero(q, k, scale, mask, out):
            out = out.clone()
            out[:, q_row:] = 0
            return out

        for fn in (record, zero):
            with training(model), probing(fn):
                batch = TrainBatch(torch.tensor(ids, device=device), [len(ids)], sparse=sparse)
                hidden = model(batch)
            right = int(logits_of(model, hidden[-1:]).argmax()) == first
            if fn is record:
                result.first_right += right
            else:
                result.first_right_ablated += right
        for i, w in enumerate(weights):  # [H, L] -> [H, 4]
            parts = torch.zeros(w.shape[0], len(PARTS), device=device).index_add_(1, labels, w)
            if len(sums) <= i:
                sums.append(parts)
            else:
                sums[i] += parts
    result.mass = [s.cpu() / n for s in sums]
    return result


def table(probes: list[RecallProbe]) -> str:
    """A context length a row: the first digit's accuracy, with the attention zeroed, and each attention layer's
    mean weight (over heads) on the asked pair, the other pairs and the filler, with the best head's on the pair."""
    layers = len(probes[0].mass) if probes else 0
    head = ["context", "n", "first digit", "attention zeroed"]
    for i in range(layers):
        head += [f"attn {i}: asked", "best head", "others", "filler"]
    rows = [head]
    for p in probes:
        row = [str(p.context_len), str(p.n), f"{p.first_right / p.n:.0%}", f"{p.first_right_ablated / p.n:.0%}"]
        for m in p.mass:
            mean = m.mean(0)
            row += [f"{mean[0]:.3f}", f"{m[:, 0].max():.3f}", f"{mean[1]:.3f}", f"{mean[2]:.3f}"]
        rows.append(row)
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    lines = ["  ".join(x.rjust(w) for x, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(probes: list[RecallProbe], path: str, title: str = "") -> None:
    """Accuracy of the first digit (as is, attention zeroed) and each attention layer's weight on the asked
    pair, by context length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [p.context_len for p in probes]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(xs, [p.first_right / p.n for p in probes], "o-", label="as is")
    a.plot(xs, [p.first_right_ablated / p.n for p in probes], "s--", label="attention zeroed over the question")
    a.set(xscale="log", xlabel="context (tokens)", ylabel="first digit right", ylim=(0, 1.05))
    a.legend()
    for i in range(len(probes[0].mass) if probes else 0):
        b.plot(xs, [float(p.mass[i][:, 0].mean()) for p in probes], "o-", label=f"attention layer {i}: mean head")
        b.plot(xs, [float(p.mass[i][:, 0].max()) for p in probes], "^:", label=f"attention layer {i}: best head")
    b.set(xscale="log", xlabel="context (tokens)", ylabel="weight on the asked pair")
    b.legend(fontsize=8)
    for ax in (a, b):  # the lengths probed as the ticks
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.minorticks_off()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
