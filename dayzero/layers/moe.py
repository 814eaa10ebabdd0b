"""Mixture-of-Experts block: router, routed experts (stacked weights), shared experts, LatentMoE.

Experts are stored stacked (``w1`` [E, 2I, L] with gate rows then up rows, ``w2`` [E, L, I]) so the
expert computation is one GEMM per expert over the tokens routed to it, and so expert parallelism and
quantised (MXFP4) storage can later replace the tensors without touching the model. The routed experts
run as separate ops, route -> permute -> grouped expert MLP -> unpermute: none waits on the host on CUDA
(the block can be captured in a CUDA graph), and expert parallelism can put its all-to-all between them. Without
expert parallelism and gradients they run with the router as the one op ``moe_experts_routed``, whose CUDA
implementation, on a decode step's few pairs, skips the sort and routes inside the first expert kernel.

With ``latent_size`` set (LatentMoE, ARCHITECTURE.md 3.3) routing still reads the full-width x, but the
routed experts run at width L between a shared down-projection ``fc1_latent_proj`` [L, D] and
up-projection ``fc2_latent_proj`` [D, L]; an optional RMSNorm on the experts' latent output (the Kimi K3
variant) sits before the up-projection.

Under tensor parallelism the shared experts are split as a dense :class:`MLP` (gate/up column-parallel, down
row-parallel, one all-reduce) and, without expert parallelism, so is every routed expert (expert TP: each rank
holds a slice of every expert's intermediate width and the routed output's partial sums are all-reduced); the
router and the latent projections stay whole on every rank.

Under expert parallelism (ep > 1) rank r holds experts [r·E/ep, (r+1)·E/ep) and routes its share of the step's
tokens (every rank holds them all): the permuted rows travel to their experts' ranks and back with two
all-to-alls whose per-rank counts come from one all-gather of the per-expert counts, and one all-gather
reassembles the tokens. The split sizes are read on the host, so an expert-parallel step runs eagerly.

Every layer counts the (token, expert) pairs routed to each expert without a host read (``load_ends``, read by
:func:`expert_loads`; every rank's tokens under ep): the counters behind ``/metrics`` and ``dayzero profile``.
"""
from __future__ import annotations

import torch
from torch import nn

from dayzero import ops
from dayzero.config.spec import MLPSpec, MoESpec
from dayzero.distributed import (SINGLE, ParallelState, divide, ep_all_gather, ep_all_to_all, etp_all_reduce,
                                 tp_all_gather)
from dayzero.layers.expert_placement import balanced_placement, initial_placement, move_experts, replica_table
from dayzero.layers.fused import fuse, project
from dayzero.layers.mlp import MLP
from dayzero.layers.norm import RMSNorm
from dayzero.layers.parallel import PLAIN_LINEARS, Linear, Shard
from dayzero.quant.fp8 import TileScaled


class MoE(nn.Module):
    _replicated = ("e_score_correction_bias", "tid2eid")  # indexed by every expert id, whole on every rank
    takes_projected = True  # forward may be given fused_in(x), computed with the input norm

    def __init__(self, hidden: int, spec: MoESpec, eps: float = 1e-6, vocab_size: int = 0,
                 parallel: ParallelState = SINGLE):
        super().__init__()
        D, I = hidden, spec.intermediate_size
        El = divide(spec.n_experts, parallel, "n_experts", over="ep")  # the experts a rank loads
        E = El + parallel.redundant_experts // parallel.ep_size  # the expert slots this rank holds
        L = spec.latent_size or D
        self.spec, self.parallel = spec, parallel
        if parallel.ep_size > 1:  # which expert each slot of every rank holds (expert_placement)
            self.slot_expert = initial_placement(spec.n_experts, parallel.ep_size, E)
            self.in_order = self.slot_expert == list(range(len(self.slot_expert)))
            replicas, copies = replica_table(self.slot_expert, spec.n_experts)
            self.register_buffer("replicas", replicas, persistent=False)
            self.register_buffer("copies", copies, persistent=False)
            self.register_buffer("slot_of", torch.tensor(self.slot_expert), persistent=False)
        # running sums of moe_permute's row ends: their differences are the pairs routed to each expert
        self.register_buffer("load_ends", torch.zeros(spec.n_experts, dtype=torch.int64), persistent=False)
        # each expert's intermediate width split over etp ranks (expert TP): tp without expert parallelism, the
        # ranks of an expert-TP group with 1 < ep < the stage's ranks
        self.expert_tp = parallel.etp_size > 1
        if self.expert_tp:
            what = f"tp={parallel.tp_size}" if parallel.ep_size == 1 else f"ep={parallel.ep_size} (expert TP over {parallel.etp_size})"
            I = divide(I, parallel, "moe_intermediate_size", over="etp")
            if spec.expert_format == "fp8_block" and I % 128:
                raise ValueError(f"{what} splits block-FP8 experts into {I}-wide slices, not whole 128-wide scale "
                                 "tiles; use a layout whose expert split divides moe_intermediate_size / 128")
            if spec.expert_format == "mxfp4" and I % 32:
                raise ValueError(f"{what} splits MXFP4 experts into {I}-wide slices, not whole 32-value "
                                 "blocks; use a layout whose expert split divides moe_intermediate_size / 32")
        gated = spec.activation != "relu2"
        rows = 2 * I if gated else I
        self.clamp = {} if spec.swiglu_limit is None else {"limit": spec.swiglu_limit}  # the experts' clamped SwiGLU
        # The router stays in fp32: selection is sensitive to rounding (ARCHITECTURE.md 3.1).
        N = spec.n_experts  # the router chooses among all of them
        self.gate = nn.Linear(D, N, bias=spec.router_bias, dtype=torch.float32)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(N, dtype=torch.float32)) if spec.correction_bias else None
        # hash routing (DeepSeek-V4): a frozen token id -> expert ids table [vocab, k] replaces the choice by score;
        # until a checkpoint fills it, token t goes to experts (t·k + j) mod E, j < k
        self.tid2eid = None
        if spec.hash_routing:
            table = (torch.arange(vocab_size)[:, None] * spec.top_k + torch.arange(spec.top_k)) % N
            self.tid2eid = nn.Parameter(table, requires_grad=False)
        self.packed = spec.expert_format == "mxfp4"
        if self.packed:  # MXFP4: E2M1 codes [.., K/32, 16] + E8M0 scales [.., K/32], converted by the workspace
            for name, (n, k) in (("w1", (rows, L)), ("w2", (L, I))):
                if k % 32:
                    raise ValueError(f"MXFP4 experts need {name}'s input width to be a multiple of 32, got {k}")
                setattr(self, f"{name}_blocks", nn.Parameter(torch.empty(E, n, k // 32, 16, dtype=torch.uint8), requires_grad=False))
                setattr(self, f"{name}_scales", nn.Parameter(torch.empty(E, n, k // 32, dtype=torch.uint8), requires_grad=False))
            self.workspace = None  # set by the engine: one ExpertWorkspace shared by every MoE layer
            self.next_moe = None  # the next packed MoE layer, converted while this one computes
        else:
            self.w1 = nn.Parameter(torch.empty(E, rows, L))  # [E, 2I, L]: gate rows then up rows
            self.w2 = nn.Parameter(torch.empty(E, L, I))  # [E, L, I]
        self.fp8 = spec.expert_format == "fp8_block"
        self.fp8_activations = False  # the engine's choice: FP8 x FP8 expert products (TileScaled.fp8_activations)
        if self.fp8:  # DeepSeek block FP8: e4m3 weights + fp32 scale_inv per 128×128 tile, kept in FP8
            if I % 128:
                raise ValueError(f"block-FP8 experts need the expert width to be a multiple of 128, got {I}")
            for name, (n, k) in (("w1", (rows, L)), ("w2", (L, I))):
                setattr(self, name, nn.Parameter(torch.empty(E, n, k, dtype=torch.float8_e4m3fn), requires_grad=False))
                setattr(self, f"{name}_scale_inv", nn.Parameter(torch.empty(E, -(-n // 128), -(-k // 128), dtype=torch.float32), requires_grad=False))
        self.b1 = nn.Parameter(torch.empty(E, rows)) if spec.expert_bias else None
        self.b2 = nn.Parameter(torch.empty(E, L)) if spec.expert_bias else None
        width = {}  # expert TP: w1's gate and up rows, w2's input columns (dim 2 of [E, L, I] and of [E, L, I/32, ..])
        if self.expert_tp:
            etp, r = parallel.etp_size, parallel.etp_rank
            first = Shard(1, r, etp, 2 if gated else 1)
            width = {n: first for n in ("w1", "w1_blocks", "w1_scales", "w1_scale_inv", "b1")
                     if getattr(self, n, None) is not None}
            width |= {n: Shard(2, r, etp) for n in ("w2", "w2_blocks", "w2_scales", "w2_scale_inv")
                      if getattr(self, n, None) is not None}
        if parallel.ep_size > 1:  # every stacked expert tensor holds this rank's slots, the first El from the checkpoint
            self.shards = {n: Shard(0, parallel.ep_rank, parallel.ep_size, experts=El, inner=width.get(n))
                           for n, _ in self.named_parameters(recurse=False) if n not in self._replicated}
        elif width:
            self.shards = width
        self.latent = spec.latent_size is not None
        if self.latent:
            self.fc1_latent_proj = Linear(D, L, bias=False)
            self.fc2_latent_proj = Linear(L, D, bias=False)
            self.latent_norm = RMSNorm(L, eps) if spec.latent_norm else None
        shared_limit = spec.swiglu_limit if spec.shared_clamp else None
        self.shared_experts = (
            MLP(D, MLPSpec(spec.shared_intermediate_size, "relu2" if spec.activation == "relu2" else "silu",
                           swiglu_limit=shared_limit), parallel, what="shared_intermediate_size")
            if spec.n_shared else None
        )
        self.shared_expert_gate = Linear(D, 1, bias=False) if spec.shared_gate else None
        # LatentMoE: the latent down-projection and the shared expert's input projections read the same x, one
        # GEMM once fused (dayzero.layers.fused)
        self.in_proj_members = []
        if self.latent and self.shared_experts is not None:
            self.in_proj_members = ["fc1_latent_proj", "shared_experts.gate_up_proj"]
            self.in_proj_members += ["shared_expert_gate"] * (self.shared_expert_gate is not None)

    def expert_tensors(self) -> list[torch.Tensor]:
        """The stacked tensors holding this rank's expert slots (weights, scales, biases)."""
        return [t for n, t in self.named_parameters(recurse=False) if n not in self._replicated]

    def place(self, slot_expert: list[int], old: list[int] | None = None) -> None:
        """Move this layer's experts to ``slot_expert`` (expert_placement); ``old``: the placement the tensors
        hold now (default: the current one)."""
        move_experts(self.expert_tensors(), self.slot_expert if old is None else old, slot_expert, self.parallel)
        if self.packed and self.workspace is not None:
            self.workspace.forget(self)  # nothing it converted or kept holds the new placement
        replicas, copies = replica_table(slot_expert, self.spec.n_experts)
        dev = self.copies.device
        self.replicas, self.copies = replicas.to(dev), copies.to(dev)
        self.slot_of = torch.tensor(slot_expert, device=dev)
        self.slot_expert = list(slot_expert)
        self.in_order = self.slot_expert == list(range(len(slot_expert)))

    def process_weights_after_loading(self) -> None:
        """Fuse the input projections; fill the redundant expert slots from the loaded experts; check the
        hash-routing table once, after loading, so that routing never reads ids back to the host."""
        if self.in_proj_members:
            fuse(self, "fused_in", self.in_proj_members)
        if self.expert_tp and self.b2 is not None and self.parallel.etp_rank:
            self.b2.data.zero_()  # each rank's partial output is summed over the expert split: one rank adds the bias
        if self.parallel.redundant_experts:
            per, S = self.spec.n_experts // self.parallel.ep_size, len(self.slot_expert) // self.parallel.ep_size
            loaded = [e if q % S < per else -1 for q, e in enumerate(self.slot_expert)]  # what the checkpoint filled
            self.place(self.slot_expert, old=loaded)
        if self.tid2eid is None:
            return
        E, k = self.spec.n_experts, self.spec.top_k
        table = self.tid2eid
        if table.dim() != 2 or table.shape[1] != k:
            raise ValueError(f"tid2eid must be [vocab, top_k={k}], got {tuple(table.shape)}")
        if table.numel():
            lo, hi = int(table.min()), int(table.max())
            if lo < 0 or hi >= E:
                raise ValueError(f"tid2eid holds expert ids in [{lo}, {hi}], outside [0, {E})")

    @property
    def _scale_in_weights(self) -> bool:
        # The routed scale multiplies the routed output: it commutes with the sum over experts and the bias-free
        # fc2, so it rides on the routing weights, except after a latent norm (which would cancel it) where it
        # multiplies the output.
        return self.latent_norm is None if self.latent else True

    def route_args(self) -> dict:
        """``moe_route``'s arguments after the logits, by name (in its order)."""
        s = self.spec
        return dict(top_k=s.top_k, kind=s.router, correction_bias=self.e_score_correction_bias, n_group=s.n_group,
                    topk_group=s.topk_group, norm_topk_prob=s.norm_topk_prob,
                    routed_scaling_factor=s.routed_scaling_factor if self._scale_in_weights else 1.0)

    def _route(self, x: torch.Tensor, batch, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights fp32 [t, k] and expert ids [t, k] of the tokens ``x`` (rows ``rows`` of the step)."""
        if self.tid2eid is None:  # the router's fp32 logits and their routing (one launch on a decode step's rows)
            return ops.call("moe_router", x, self.gate.weight, self.gate.bias, **self.route_args())
        if batch is None:
            raise ValueError("a hash-routed MoE layer needs the step's batch (its token ids)")
        logits = ops.call("linear", x, self.gate.weight, self.gate.bias, out_dtype=torch.float32)  # [t, E] fp32
        fixed = self.tid2eid[batch.input_ids[rows]]  # [t, k]
        return ops.call("moe_route", logits, **self.route_args(), fixed_ids=fixed)

    def _experts(self, h, offsets, order, top_k, w1, w2) -> torch.Tensor:
        return ops.call("moe_experts_grouped", h, offsets, w1, w2, self.spec.activation, self.b1, self.b2,
                        **self.clamp, order=order, top_k=top_k)

    def router_first(self) -> nn.Linear | None:
        """The router, when the decoder layer computes its logits with the input norm, before this layer's own
        input projection (``forward(logits=)``): the experts' input h is then a projection run between the two,
        so the routed experts' first kernel may route and read its expert's weights before waiting for it
        (``moe_experts_routed``). None where h is x itself (no latent projection), or the routing is by hash,
        across expert-parallel ranks or for training."""
        if (not self.latent or self.tid2eid is not None or self.parallel.ep_size > 1 or torch.is_grad_enabled()
                or type(self.gate) is not nn.Linear):
            return None
        return self.gate

    def _routed(self, x, h, w1, w2, batch, logits: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts' weighted sum [T, L] for every token, all experts on this rank; ``logits``: the
        router's, computed before h (:meth:`router_first`)."""
        k = self.spec.top_k
        if not torch.is_grad_enabled() and self.tid2eid is None:  # one op, free to route inside the experts' kernels
            y = ops.call("moe_experts_routed", x, h, self.gate.weight, self.gate.bias, w1, w2, self.spec.activation,
                         self.b1, self.b2, **self.clamp, load=self.load_ends, **self.route_args(), logits=logits)
            return etp_all_reduce(y, self.parallel) if self.expert_tp else y
        weights, ids = self._route(x, batch)
        if torch.is_grad_enabled():  # training: the three ops below, each with a backward (the train platform's)
            # [T*k] pairs by expert, [E] row ends (added to the load counters in the same kernel)
            order, offsets = ops.call("moe_permute", ids, self.spec.n_experts, load=self.load_ends)
            # [T*k, L] rows in expert order, each read from its token's row of h (order[r] // top_k)
            ys = self._experts(h, offsets, order, k, w1, w2)
            y = ops.call("moe_unpermute", ys, order, weights, x.shape[0])  # [T, L]
        else:  # one op, free to skip the sort when the step has few pairs (a decode step)
            y = ops.call("moe_experts", h, ids, weights, w1, w2, self.spec.activation, self.b1, self.b2, **self.clamp,
                         load=self.load_ends)  # [T, L]
        return etp_all_reduce(y, self.parallel) if self.expert_tp else y  # expert TP: the slices' partial sums

    def _routed_ep(self, x, h, w1, w2, batch) -> torch.Tensor:
        """:meth:`_routed` with the experts spread over the ep ranks: this rank routes its share of the tokens,
        sends each pair's row to the rank holding (a copy of) its expert and gets the outputs back, then the
        shares are gathered. The ranks that hold the same tokens share them out: the expert group, or under
        attention data parallelism (where each replica holds its own) the tp group."""
        p = self.parallel
        etp = p.etp_size if self.expert_tp else 1  # 1 < ep < G: the ranks of an expert-TP group route the same rows
        r, n = (p.tp_rank // etp, p.tp_size // etp) if p.dp_size > 1 else (p.ep_rank, p.ep_size)
        T = x.shape[0]
        per = -(-T // n)
        rows = slice(min(r * per, T), min((r + 1) * per, T))
        weights, ids = self._route(x[rows], batch, rows)  # [t, k] logical experts
        y = self._exchange(h[rows], weights, ids, w1, w2)  # [t, L]
        y = torch.nn.functional.pad(y, (0, 0, 0, per - y.shape[0]))
        if p.dp_size > 1:  # the replica's shares, each as etp partial sums over the experts' width slices
            y = tp_all_gather(y, p, dim=0)
            return (y.view(n, etp, per, -1).sum(1).flatten(0, 1) if etp > 1 else y)[:T]
        y = torch.cat(ep_all_gather(y, p))[:T]
        return etp_all_reduce(y, p) if self.expert_tp else y  # 1 < ep < G: the width slices' partial sums

    def idle(self, dtype: torch.dtype) -> None:
        """A step in which this rank's replica holds no tokens (attention data parallelism): its experts still
        serve the pairs the other replicas route to them."""
        w1, w2 = self._expert_weights()
        k, dev = self.spec.top_k, self.load_ends.device
        h = torch.empty(0, self.spec.latent_size or self.gate.in_features, dtype=dtype, device=dev)
        weights = torch.empty(0, k, dtype=torch.float32, device=dev)
        self._exchange(h, weights, torch.empty(0, k, dtype=torch.long, device=dev), w1, w2)
        if self.packed:
            self.workspace.release(self)

    def _exchange(self, h, weights, ids, w1, w2) -> torch.Tensor:
        """The weighted sums [t, L] of this rank's pairs (rows ``h`` [t, L], their experts ``ids`` [t, k]): each
        pair's row goes to the ep rank holding (a copy of) its expert, and its output comes back."""
        p, k = self.parallel, self.spec.top_k
        ep, r, S = p.ep_size, p.ep_rank, len(self.slot_expert) // p.ep_size
        if p.redundant_experts:  # the j-th pair of an expert goes to its copy j mod copies
            nth = torch.arange(ids.numel(), device=ids.device).view_as(ids)
            slots = self.replicas[ids, nth % self.copies[ids]]
        else:  # one copy each: slot e holds expert e until a rebalance permutes them
            slots = ids if self.in_order else self.replicas[ids, 0]
        order, offsets = ops.call("moe_permute", slots, ep * S)  # this rank's pairs by slot
        ends = offsets.long()
        counts = torch.diff(ends, prepend=ends.new_zeros(1))  # [ep·S]
        table = torch.stack(ep_all_gather(counts, p))  # [ep, ep·S]: pairs each rank routes to each slot
        load = torch.zeros(self.spec.n_experts, dtype=torch.int64, device=h.device)
        self.load_ends += load.index_add_(0, self.slot_of, table.sum(0)).cumsum(0)
        per_rank = table.view(ep, ep, S).sum(-1)  # [source, destination]
        send, recv = per_rank[r].tolist(), per_rank[:, r].tolist()  # the host read of the split sizes
        got = ep_all_to_all(h[order // k], send, recv, p)  # [R, L] rows for this rank's slots
        mine = table[:, r * S:(r + 1) * S].reshape(-1)  # rows per (source, local slot), in arrival order
        local = torch.repeat_interleave(torch.arange(S, device=h.device).repeat(ep), mine)  # [R]
        order2, offsets2 = ops.call("moe_permute", local[:, None], S)
        out = torch.empty_like(got)
        out[order2] = self._experts(got, offsets2, order2, 1, w1, w2)  # back in arrival order
        home = ep_all_to_all(out, recv, send, p)  # [t*k, L] this rank's pairs, in its slot order
        return ops.call("moe_unpermute", home, order, weights, h.shape[0])  # [t, L]

    def _expert_weights(self, tokens: int | None = None) -> tuple:
        """(w1, w2) as the expert ops take them for a step of ``tokens`` rows; packed MXFP4 experts are
        converted (or taken converted) into the workspace, which the caller releases, or read packed."""
        if self.packed:
            if self.workspace is None:
                raise RuntimeError("packed MXFP4 experts need an ExpertWorkspace (attach_workspace)")
            rows = None if tokens is None else tokens * self.spec.top_k / self.spec.n_experts
            w1, w2 = self.workspace.acquire(self, rows)
            self.workspace.prefetch(self.next_moe, rows)
            return w1, w2
        if self.fp8:
            a8 = self.fp8_activations
            return TileScaled(self.w1, self.w1_scale_inv, a8), TileScaled(self.w2, self.w2_scale_inv, a8)
        return self.w1, self.w2

    def _shared_in_up_projection(self, fused: dict) -> bool:
        """Whether the LatentMoE up-projection and the shared expert's activation and down projection can run as
        one ``dual_linear``: both plain linears without biases (one rank), the shared expert's gate/up from the
        fused input projection, no shared gate, no scale on the routed sum."""
        s = self.spec
        return (self.latent and self.shared_experts is not None and "shared_experts.gate_up_proj" in fused
                and self.shared_expert_gate is None and (self._scale_in_weights or s.routed_scaling_factor == 1.0)
                and _plain(self.fc2_latent_proj) and _plain(self.shared_experts.down_proj))

    def forward(self, x: torch.Tensor, batch=None, projected: torch.Tensor | None = None,
                logits: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, D]; ``batch`` gives hash routing its token ids; ``projected``: ``fused_in(x)`` when the caller
        # computed it (with the input norm, DecoderLayer._mix); ``logits``: the router's fp32 logits of x when the
        # caller computed them (with the input norm, :meth:`router_first`), in which case h is projected here
        s = self.spec
        if logits is not None and (projected is not None or self.router_first() is None):
            raise ValueError("router logits are taken only by a layer that routes first, with h projected after them")
        fused = {}  # member name -> its output, when the input projections run as one GEMM
        if "fused_in" in self._modules:
            fused = dict(zip(self.in_proj_members, project(self, "fused_in", self.in_proj_members, x, projected)))
        h = x  # [T, L]
        if self.latent:
            h = fused["fc1_latent_proj"] if fused else self.fc1_latent_proj(x)
        w1, w2 = self._expert_weights(x.shape[0])
        y = (self._routed(x, h, w1, w2, batch, logits) if self.parallel.ep_size == 1
             else self._routed_ep(x, h, w1, w2, batch))
        if self.packed:
            self.workspace.release(self)
        shared = None
        if self._shared_in_up_projection(fused):  # the shared expert's activation and down projection with fc2
            mlp = self.shared_experts
            return ops.call("dual_linear", self.latent_norm(y) if self.latent_norm is not None else y,
                            self.fc2_latent_proj.weight, fused["shared_experts.gate_up_proj"], mlp.down_proj.weight,
                            mlp.activation, mlp.clamp.get("limit"))
        if self.shared_experts is not None:
            shared = self.shared_experts.down(fused["shared_experts.gate_up_proj"]) if fused else self.shared_experts(x)
            if self.shared_expert_gate is not None:
                g = fused["shared_expert_gate"] if fused else self.shared_expert_gate(x)
                shared = ops.call("sigmoid_gate", shared[:, None], g[:, None])[:, 0]
        out_scale = 1.0 if self._scale_in_weights else s.routed_scaling_factor
        if self.latent:
            if self.latent_norm is not None:
                y = self.latent_norm(y)
            fc2 = self.fc2_latent_proj
            if shared is not None and out_scale == 1.0 and type(fc2) in PLAIN_LINEARS and fc2.bias is None:
                return ops.call("linear", y, fc2.weight, add=shared)  # the shared expert added in the epilogue
            y = fc2(y)
        if out_scale != 1.0:
            y = y * out_scale
        return y if shared is None else y + shared


def _plain(proj: nn.Module) -> bool:
    return type(proj) in PLAIN_LINEARS and proj.bias is None


def expert_loads(layers: list[MoE]) -> list[torch.Tensor]:
    """Per layer, the (token, expert) pairs routed to each expert since the start (or the last
    :func:`reset_loads`), host int64 [n_experts]; one read of the device for all the layers."""
    if not layers:
        return []
    ends = torch.cat([m.load_ends for m in layers]).cpu()
    return [torch.diff(e, prepend=e.new_zeros(1)) for e in ends.split([m.spec.n_experts for m in layers])]


def rebalance_experts(layers: list[MoE], loads: list[torch.Tensor]) -> int:
    """Place each expert-parallel layer's experts for its ``loads`` (pairs per expert, e.g. over a recent window)
    and move them (every rank at the same point of the run); returns the slots whose expert changed."""
    changed = 0
    for m, load in zip(layers, loads):
        if m.parallel.ep_size == 1:
            continue
        new = balanced_placement(load.tolist(), m.parallel.ep_size, len(m.slot_expert) // m.parallel.ep_size)
        changed += sum(a != b for a, b in zip(new, m.slot_expert))
        m.place(new)
    return changed


def reset_loads(layers: list[MoE]) -> None:
    for m in layers:
        m.load_ends.zero_()


def attach_workspace(model: nn.Module, workspace) -> list[MoE]:
    """Give every packed MoE layer of ``model`` the one shared workspace, chained for prefetching;
    returns those layers."""
    packed = [m for m in model.modules() if isinstance(m, MoE) and m.packed]
    for a, b in zip(packed, packed[1:] + [None]):
        a.workspace = workspace
        object.__setattr__(a, "next_moe", b)  # a plain reference, not a registered submodule
    if packed:
        workspace.reserve(packed)
    return packed


@torch.no_grad()
def unpack_experts(moe: MoE, dtype: torch.dtype) -> None:
    """Keep one layer's experts in high precision: dequantise its packed weights once into dense ones."""
    from dayzero.quant.mxfp4 import dequantize_mxfp4

    for name in ("w1", "w2"):
        blocks, scales = getattr(moe, f"{name}_blocks"), getattr(moe, f"{name}_scales")
        setattr(moe, name, nn.Parameter(dequantize_mxfp4(blocks, scales, dtype), requires_grad=False))
        delattr(moe, f"{name}_blocks")
        delattr(moe, f"{name}_scales")
    moe.packed, moe.workspace = False, None
    object.__setattr__(moe, "next_moe", None)
