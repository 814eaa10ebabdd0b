"""Reference greedy sampling: the sampler's own torch ops for rows that take the argmax."""
from __future__ import annotations

import torch

from dayzero.ops.registry import register


@register("greedy_sample")
def greedy_sample(logits: torch.Tensor, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids int64 [B], log-probabilities fp32 [B]) of ``logits`` [B, V]: each row's first maximum and its
    log-probability under the row's softmax; a row holding NaN or ±inf gets id -1 and log-probability NaN.
    ``rows`` [B, 2] fp64, when given, also receives each row's (id, log-probability): the form the sampler copies
    to the host."""
    x = logits.float()
    ok = torch.isfinite(x).all(dim=-1)
    x = x.masked_fill(~ok[:, None], 0.0)
    ids = x.argmax(dim=-1)
    logprobs = x.gather(1, ids[:, None])[:, 0] - torch.logsumexp(x, dim=-1)
    ids, logprobs = torch.where(ok, ids, -1), torch.where(ok, logprobs, float("nan"))
    if rows is not None:
        rows.copy_(torch.stack([ids.double(), logprobs.double()], 1))
    return ids, logprobs
