"""Where the routed experts live under expert parallelism, and moving them between ranks (EPLB-style balancing).

Each of the ``ep`` ranks has ``S = E/ep + R/ep`` expert slots, ``R`` being the redundant slots of the layer: physical
slot ``p = rank·S + local slot`` holds logical expert ``slot_expert[p]``, and an expert with ``c`` copies sends
its j-th routed pair (counted over the step's pairs) to copy ``j mod c``, so the copies share its load. All copies
hold the same bytes, so where a pair runs never changes its output.

- At load time rank r's first ``E/ep`` slots hold experts ``r·E/ep ..`` (the checkpoint's order) and its redundant
  slots copies of the next rank's first experts (:func:`initial_placement`).
- :func:`balanced_placement` recomputes a placement from observed loads: each redundant slot goes to the expert
  with the highest load per copy (at most one copy per rank while any expert has fewer), then copies are placed heaviest first on the least-loaded rank that has a free
  slot and no copy of that expert yet.
- :func:`move_experts` carries every expert tensor of a layer to a new placement with one all-to-all per tensor
  (a rank that already holds an expert copies it locally).

Every rank computes the same placement from the same loads (they are counted over every rank's tokens), so the
ranks agree without a message.
"""
from __future__ import annotations

import heapq

import torch

from dayzero.distributed import ParallelState, ep_all_to_all


def initial_placement(num_experts: int, ep: int, slots: int) -> list[int]:
    """The checkpoint's order: rank r holds experts [r·E/ep, (r+1)·E/ep), then copies of the next rank's first
    ``slots - E/ep`` experts."""
    per = num_experts // ep
    out = []
    for r in range(ep):
        nxt = (r + 1) % ep
        out += list(range(r * per, (r + 1) * per)) + [nxt * per + j % per for j in range(slots - per)]
    return out


def balanced_placement(load: list[float], ep: int, slots: int) -> list[int]:
    """``slot_expert`` [ep·slots] for the per-expert ``load``: the extra slots go to the hottest experts (by load
    per copy), then copies are packed heaviest first onto the least-loaded rank with room."""
    E = len(load)
    if ep * slots < E:
        raise ValueError(f"{ep} ranks of {slots} slots cannot hold {E} experts")
    copies = [1] * E
    heap = [(-float(load[e]), e) for e in range(E)]
    heapq.heapify(heap)
    full = []  # experts with a copy on every rank: another copy would share a rank
    for _ in range(ep * slots - E):
        if not heap:
            heap, full = full, []
            heapq.heapify(heap)
        _, e = heapq.heappop(heap)
        copies[e] += 1
        entry = (-float(load[e]) / copies[e], e)
        if copies[e] < ep:
            heapq.heappush(heap, entry)
        else:
            full.append(entry)
    items = sorted(((float(load[e]) / copies[e], e) for e in range(E) for _ in range(copies[e])),
                   key=lambda x: (-x[0], x[1]))
    rank_load, held = [0.0] * ep, [[] for _ in range(ep)]
    for w, e in items:
        free = [r for r in range(ep) if len(held[r]) < slots]
        fresh = [r for r in free if e not in held[r]] or free  # two copies on one rank share nothing
        r = min(fresh, key=lambda r: (rank_load[r], r))
        held[r].append(e)
        rank_load[r] += w
    return [e for r in range(ep) for e in sorted(held[r])]


def replica_table(slot_expert: list[int], num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(replicas int64 [E, max copies], copies int64 [E])``: the physical slots holding each expert (a row
    padded with its first slot)."""
    where: list[list[int]] = [[] for _ in range(num_experts)]
    for p, e in enumerate(slot_expert):
        where[e].append(p)
    missing = [e for e, w in enumerate(where) if not w]
    if missing:
        raise ValueError(f"the placement holds no copy of experts {missing[:8]}")
    width = max(len(w) for w in where)
    table = torch.tensor([w + [w[0]] * (width - len(w)) for w in where], dtype=torch.int64)
    return table, torch.tensor([len(w) for w in where], dtype=torch.int64)


def move_experts(tensors: list[torch.Tensor], old: list[int], new: list[int], parallel: ParallelState) -> None:
    """Rewrite each stacked expert tensor [S, ...] of this rank (in place) from placement ``old`` to ``new``
    (``slot_expert`` lists; -1 in ``old``: an empty slot). Each new slot's expert comes from its own rank when it
    holds a copy, else from the lowest rank that does."""
    ep, r = parallel.ep_size, parallel.ep_rank
    S = len(new) // ep
    holders: dict[int, dict[int, int]] = {}  # expert -> {rank: its first local slot holding it}
    for p, e in enumerate(old):
        if e >= 0:
            holders.setdefault(e, {}).setdefault(p // S, p % S)

    def source(d: int, e: int) -> int:
        if e not in holders:
            raise ValueError(f"expert {e} is in the new placement but no rank holds it")
        return d if d in holders[e] else min(holders[e])

    send_rows, send = [], [0] * ep  # rows of this rank's old slots, grouped by destination rank
    for d in range(ep):
        for s in range(S):
            e = new[d * S + s]
            if source(d, e) == r:
                send_rows.append(holders[e][r])
                send[d] += 1
    recv, arrival = [0] * ep, [[] for _ in range(ep)]  # this rank's new slots, grouped by source rank
    for s in range(S):
        src = source(r, new[r * S + s])
        recv[src] += 1
        arrival[src].append(s)
    index = torch.tensor(send_rows, dtype=torch.int64)
    slots = torch.tensor([s for a in arrival for s in a], dtype=torch.int64)
    for t in tensors:
        raw = t.detach().reshape(S, -1).view(torch.uint8)  # any dtype moves as its bytes
        got = ep_all_to_all(raw[index.to(raw.device)], send, recv, parallel)
        out = torch.empty_like(raw)
        out[slots.to(raw.device)] = got
        t.data.copy_(out.view(t.dtype).view(t.shape))
