"""``dayzero plan MODEL --devices 16xH200``: memory per device for each parallel layout, the layouts that
fit, the best one by a roofline model of decode and prefill, and the longest context that fits.

Every formula is in docs/planning.md. Layouts: pipeline stages ``pp`` of contiguous layers; inside a stage
of ``G = N/pp`` devices, attention runs tensor parallel over ``tp`` and data parallel over ``dp = G/tp``
(each DP rank holds its own sequences); routed experts spread over all ``G`` devices as expert parallel
``ep`` times expert tensor parallel ``G/ep``.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace

from dayzero.cache.planner import DEFAULT_BLOCK_SIZE, window_pool_blocks
from dayzero.distributed import pipeline_stages
from dayzero.multimodal.costs import cache_rows
from dayzero.ops.indexer.triton_indexer import scratch_bytes as indexer_scratch_bytes
from dayzero.quant.workspace import FUSED_ROWS_PER_EXPERT, converts_to_tiles, reads_packed
from dayzero.tools import fmt
from dayzero.tools.devices import DeviceKind, parse_device_spec, parse_devices
from dayzero.tools.model_info import FORMAT_TORCH, block_size_of, declared_format, load
from dayzero.tools.plan_costs import LayerCost, ModelCosts, Row, attn_flops, expert_format, model_costs

MEMORY_TERMS = ("weights", "workspace", "kv_cache", "state", "activations", "indexer_scratch", "moe_dispatch",
                "comm_buffers", "runtime")


@dataclass(frozen=True)
class PlanConfig:
    devices: int = 1
    device: DeviceKind | None = None
    context: int | None = None  # tokens per sequence; default: the model's maximum
    batch: int = 1  # sequences decoded together
    kv_cache_dtype: str = "auto"
    dtype: str = "bf16"  # activations and unquantised weights
    experts: str = "auto"  # routed-expert storage: auto (as the checkpoint/config says) | bf16 | fp8 | mxfp4
    conversion: str = "auto"  # MXFP4 experts: a bf16 or fp8 workspace, "fused" (none), or "auto" (per step, as the engine)
    block_size: int | None = None  # None: the engine's default (16, or compressed rows' stride when larger)
    prefill_chunk: int = 8192  # tokens per DP rank per prefill step
    moe_imbalance: float = 1.5  # expert receive buffers sized for this multiple of the average load
    memory_fraction: float = 0.92  # of device memory the plan may use
    runtime_gib: float = 2.0  # runtime context, library workspaces, collective-library buffers
    workspace_slots: int = 2  # expert conversion buffers: two on GPUs (the next layer converts while one runs)
    fp8_activations: bool = False  # as the engine's option: MXFP4 experts converted into FP8 tiles, not bf16


@dataclass(frozen=True)
class Layout:
    pp: int
    tp: int
    dp: int
    ep: int

    @property
    def etp(self) -> int:
        return self.tp * self.dp // self.ep

    def __str__(self) -> str:
        return f"pp{self.pp} tp{self.tp} dp{self.dp} ep{self.ep}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(costs: ModelCosts, n: int) -> list[Layout]:
    moe = [lc for lc in costs.layers if lc.is_moe]
    out = []
    for pp in _divisors(n):
        if pp > len(costs.layers):
            continue
        g = n // pp
        for tp in _divisors(g):
            if any(h % tp for h in costs.heads):
                continue
            eps = [ep for ep in _divisors(g)
                   if all(lc.n_experts % ep == 0 and lc.expert_inter % (g // ep) == 0 for lc in moe)] if moe else [g]
            out += [Layout(pp, tp, g // tp, ep) for ep in eps]
    return out


def engine_gap(lay: Layout) -> str | None:
    """Why dayzero's engine cannot run ``lay`` yet, or None when it can (``check_layout``'s rules): the plan
    models every layout worth considering, the engine runs a subset of them today."""
    g = lay.tp * lay.dp
    if lay.dp > 1 and lay.ep not in (1, g) and lay.tp % (g // lay.ep):
        return (f"attention data parallelism (dp={lay.dp}) takes ep=1, ep=tp·dp={g}, or expert-TP groups of "
                f"tp·dp/ep={g // lay.ep} ranks inside a replica of tp={lay.tp}")
    return None


# --- memory ---------------------------------------------------------------------------------------------
def _shard(max_shards: int, tp: int) -> int:
    return min(tp, max_shards)


def kv_bytes_per_token(lc: LayerCost, tp: int) -> float:
    return sum(r.bytes_per_token / _shard(r.max_shards, tp) for r in lc.rows)


def held_tokens(lc: LayerCost, row: Row, tokens: int, seqs: int, block_size: int, chunk: int) -> int:
    """Tokens of a row's cache that ``seqs`` sequences of ``tokens`` tokens hold together: all of them, or for a
    sliding window what the engine's windowed pool keeps (:func:`~dayzero.cache.planner.window_pool_blocks`)."""
    if row.read != "window":
        return seqs * tokens
    return (window_pool_blocks(lc.window, block_size, chunk, seqs, -(-tokens // block_size)) - 1) * block_size


def kv_bytes(ls: list[LayerCost], tp: int, tokens: int, seqs: int, block_size: int, chunk: int) -> float:
    """Paged cache bytes ``seqs`` sequences of ``tokens`` tokens hold in layers ``ls``."""
    return sum(held_tokens(lc, r, tokens, seqs, block_size, chunk) * r.bytes_per_token / _shard(r.max_shards, tp)
               for lc in ls for r in lc.rows)


def state_bytes(lc: LayerCost, tp: int) -> float:
    return sum(b / _shard(s, tp) for b, s in lc.state)


def stage_memory(costs: ModelCosts, cfg: PlanConfig, lay: Layout, layer_ids: range, first: bool, last: bool,
                 context: int, chunk: int) -> dict[str, float]:
    """Bytes per device of one pipeline stage, by term, for sequences of ``context`` tokens and prefill
    chunks of ``chunk`` tokens per DP rank."""
    g, a_b = lay.tp * lay.dp, _act_bytes(cfg)
    ls = [costs.layers[i] for i in layer_ids]
    seqs = math.ceil(cfg.batch / lay.dp)
    bs = cfg.block_size or DEFAULT_BLOCK_SIZE  # plan() resolves it per model; direct callers get the default
    tokens = -(-context // bs) * bs
    weights = sum(lc.tp_bytes / lay.tp + lc.rep_bytes + lc.expert_bytes / g for lc in ls) + costs.vision_bytes
    if first:
        weights += costs.embed_bytes / lay.tp
    if last:
        weights += costs.head_bytes / lay.tp + costs.other_bytes
    if first and last and costs.tied:
        weights -= costs.head_bytes / lay.tp  # one tensor serves as embedding and LM head
    workspace = cfg.workspace_slots * max((lc.expert_ws_bytes / g for lc in ls), default=0.0)
    kv = kv_bytes(ls, lay.tp, tokens, seqs, bs, chunk)
    state = seqs * sum(state_bytes(lc, lay.tp) for lc in ls)
    width = max((lc.max_width for lc in ls), default=costs.hidden)
    act = chunk * (4 * costs.hidden * a_b + 2 * 4 * width / lay.tp)
    if last:
        act += seqs * costs.vocab / lay.tp * 4  # fp32 logits of the sampled rows
    idx = max((indexer_scratch_bytes(chunk, tokens, lc.topk) for lc in ls if lc.indexer is not None), default=0.0)
    moe = [lc for lc in ls if lc.is_moe]
    dispatch = max((moe_buffers(lc, lay, chunk * lay.dp, cfg.moe_imbalance, a_b) for lc in moe), default=0.0)
    comm = 2 * chunk * costs.hidden * a_b * ((lay.tp > 1) + (lay.pp > 1))  # all-reduce / stage send buffers
    # the vision encoder (every rank runs it): one call of the largest image and the feature cache
    encoder = costs.encoder_call_bytes + cache_rows(chunk) * costs.encoder_row_bytes
    return {"weights": weights, "workspace": workspace, "kv_cache": kv, "state": state, "activations": act,
            "indexer_scratch": idx, "moe_dispatch": dispatch, "comm_buffers": comm, "encoder": encoder,
            "runtime": cfg.runtime_gib * 2**30 if cfg.device is not None else 0.0}


def memory(costs: ModelCosts, cfg: PlanConfig, lay: Layout, context: int) -> dict[str, float]:
    """The worst stage's memory per device, by term."""
    parts = pipeline_stages(len(costs.layers), lay.pp)
    chunk = min(cfg.prefill_chunk, context)
    per_stage = [stage_memory(costs, cfg, lay, r, s == 0, s == lay.pp - 1, context, chunk) for s, r in enumerate(parts)]
    return max(per_stage, key=lambda m: sum(m.values()))


def group_share(lc: LayerCost, ep: int) -> float:
    """Expected share of a stage's tokens that one expert-parallel group receives: a token goes to each
    distinct group among its top-k experts (uniform routing), so 1 for ep = 1 and about k/ep for large ep."""
    return 1 - (1 - 1 / ep) ** lc.top_k


def moe_buffers(lc: LayerCost, lay: Layout, tokens_stage: int, imbalance: float, a_b: int) -> float:
    """Dispatch send/receive and combine buffers plus the experts' intermediate rows, per device."""
    g = lay.tp * lay.dp
    u = group_share(lc, lay.ep)
    send = tokens_stage / g * lay.ep * u * lc.moe_width * a_b
    rows = imbalance * tokens_stage * u  # token vectors an expert group holds (all-gathered over its etp ranks)
    pairs = imbalance * tokens_stage * lc.top_k / lay.ep  # (token, expert) pairs the group computes
    return 2 * (send + rows * lc.moe_width * a_b) + pairs * lc.expert_rows / lay.etp * a_b


def moe_link_bytes(lc: LayerCost, lay: Layout, tokens_stage: float, a_b: int) -> tuple[float, int]:
    """Bytes one device sends per MoE layer (dispatch + combine) and the collectives it takes: an
    all-to-all over the ``ep`` groups, then all-gather / reduce-scatter inside each group's ``etp`` ranks."""
    g = lay.tp * lay.dp
    u = group_share(lc, lay.ep)
    nbytes, n = 0.0, 0
    if lay.ep > 1:
        nbytes += 2 * tokens_stage / g * lay.ep * u * lc.moe_width * a_b * (1 - 1 / lay.ep)
        n += 2
    if lay.etp > 1:
        nbytes += 2 * tokens_stage * u * lc.moe_width * a_b * (lay.etp - 1) / lay.etp
        n += 2
    return nbytes, n


def longest_context(costs: ModelCosts, cfg: PlanConfig, lay: Layout, budget: float, chunk: int) -> int:
    """The largest context (a block multiple, at most the model's maximum) whose memory fits ``budget``;
    memory is affine in the context for a fixed prefill chunk once it is past every sliding window (the
    windowed layers then hold a constant), so two evaluations there give the line, and a search below it."""
    parts = pipeline_stages(len(costs.layers), lay.pp)
    bs, cap = cfg.block_size or DEFAULT_BLOCK_SIZE, costs.max_position
    seqs = math.ceil(cfg.batch / lay.dp)
    # past this context the windowed pools are whole (their memory constant) and the memory affine in the context
    windows = [held_tokens(lc, r, cap, seqs, bs, chunk) // seqs for lc in costs.layers for r in lc.rows
               if r.read == "window"]
    start = -(-max([bs, *windows]) // bs) * bs
    best = cap
    for s, r in enumerate(parts):
        m = lambda L: sum(stage_memory(costs, cfg, lay, r, s == 0, s == lay.pp - 1, L, chunk).values())  # noqa: E731
        lo, hi = m(start), m(start + bs)
        if lo > budget:  # shorter than the windows: the longest block multiple that fits
            blocks = _last_true(lambda n: m(n * bs) <= budget, start // bs)
            best = min(best, blocks * bs)
            continue
        slope = (hi - lo) / bs
        if slope > 0:
            best = min(best, int(start + (budget - lo) / slope) // bs * bs)
    return max(0, min(best, cap))


def _last_true(ok, n: int) -> int:
    """The largest k in 0 .. n with ok(k), for ok true up to some point and false after it (ok(0) is assumed)."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


# --- roofline -------------------------------------------------------------------------------------------
def _act_bytes(cfg: PlanConfig) -> int:
    return 4 if cfg.dtype == "fp32" else 2


def _link(dev: DeviceKind, group: int) -> float:
    return (dev.link_gbps if group <= dev.node_size else dev.net_gbps) * 1e9


def stage_time(costs: ModelCosts, cfg: PlanConfig, lay: Layout, layer_ids: range, last: bool, seqs: int,
               tokens_rank: int, context: float, prefill: bool) -> dict[str, float]:
    """Seconds for one stage to run one step: ``tokens_rank`` tokens per DP rank (``seqs`` sequences) with
    ``context`` keys each, as max(bytes / bandwidth, FLOPs / peak) + link time + collective latency."""
    dev, g, a_b = cfg.device, lay.tp * lay.dp, _act_bytes(cfg)
    tokens_stage = tokens_rank * lay.dp
    nbytes = flops = tp_comm = ep_comm = 0.0
    n_coll = 0
    for i in layer_ids:
        lc = costs.layers[i]
        nbytes += lc.tp_bytes / lay.tp + lc.rep_bytes
        flops += 2 * tokens_rank * (lc.tp_params / lay.tp + lc.rep_params)
        flops += tokens_rank * attn_flops(lc, context, prefill) / lay.tp
        if lc.is_moe:
            touched = 1 - (1 - lc.top_k / lc.n_experts) ** tokens_stage  # expected share of experts hit
            if lc.expert_ws_bytes and not reads_packed(cfg.conversion, tokens_stage * lc.top_k / lc.n_experts):
                nbytes += (lc.expert_bytes + (1 + touched) * lc.expert_ws_bytes) / g  # all converted, the hit read
            else:
                nbytes += touched * lc.expert_bytes / g
            flops += 2 * tokens_stage * lc.top_k * lc.expert_params / lc.n_experts / g
            link, n = moe_link_bytes(lc, lay, tokens_stage, a_b)
            ep_comm += link
            n_coll += n
        for r in lc.rows:
            keys = context if r.read == "all" else min(context, lc.topk * r.stride if r.read == "topk" else lc.window)
            nbytes += seqs * keys * r.bytes_per_token / _shard(r.max_shards, lay.tp)
            if prefill:
                nbytes += tokens_rank * r.bytes_per_token / _shard(r.max_shards, lay.tp)  # rows written
        nbytes += 2 * seqs * state_bytes(lc, lay.tp)  # state read and written back
        if lay.tp > 1:
            tp_comm += 2 * 2 * (lay.tp - 1) / lay.tp * tokens_rank * costs.hidden * a_b  # attention + MLP all-reduce
            n_coll += 2
    if last:
        nbytes += costs.head_bytes / lay.tp
        flops += 2 * seqs * costs.head_params / lay.tp  # logits of each sequence's last token
    if lay.pp > 1:
        tp_comm += tokens_rank * costs.hidden * a_b
        n_coll += 1
    t_mem, t_flop = nbytes / (dev.tbps * 1e12), flops / (dev.tflops * 1e12)
    moe_group = g if any(costs.layers[i].is_moe for i in layer_ids) else 1
    latency = (dev.latency_us if max(lay.tp, moe_group) <= dev.node_size else dev.net_latency_us) * 1e-6
    t_comm = tp_comm / _link(dev, lay.tp) + ep_comm / _link(dev, g) + n_coll * latency
    return {"seconds": max(t_mem, t_flop) + t_comm, "memory_s": t_mem, "compute_s": t_flop, "comm_s": t_comm,
            "bytes": nbytes, "flops": flops, "link_bytes": tp_comm + ep_comm}


def roofline(costs: ModelCosts, cfg: PlanConfig, lay: Layout, context: int) -> dict:
    parts = pipeline_stages(len(costs.layers), lay.pp)
    micro = math.ceil(cfg.batch / lay.pp)  # pp micro-batches keep every stage busy
    seqs = math.ceil(micro / lay.dp)
    dec = [stage_time(costs, cfg, lay, r, s == lay.pp - 1, seqs, seqs, context, False) for s, r in enumerate(parts)]
    worst = max(dec, key=lambda t: t["seconds"])
    step = lay.pp * worst["seconds"]
    chunk = min(cfg.prefill_chunk, context)
    pre = [stage_time(costs, cfg, lay, r, s == lay.pp - 1, 1, chunk, context / 2, True) for s, r in enumerate(parts)]
    pworst = max(pre, key=lambda t: t["seconds"])
    bound = max(("memory", worst["memory_s"]), ("compute", worst["compute_s"]), ("comm", worst["comm_s"]),
                key=lambda x: x[1])[0]
    return {
        "decode_step_s": step,
        "decode_tokens_per_s": cfg.batch / step,
        "decode_bound": bound,
        "decode_stage": worst,
        "prefill_tokens_per_s": chunk * lay.dp / pworst["seconds"],
        "prefill_stage": pworst,
    }


# --- the plan -------------------------------------------------------------------------------------------
def predict_allocation(model: str | None, dtype: str, context: int, batch: int, block_size: int | None = None,
                       kv_cache_dtype: str = "auto", layout: Layout = Layout(1, 1, 1, 1), stage: int = 0,
                       snapshots: int | None = None) -> dict[str, float]:
    """Weights and cache bytes of one device of pipeline stage ``stage`` of ``layout`` (what the engine allocates
    there for ``batch`` sequences of ``context`` tokens, with ``snapshots`` prefix-cache state snapshots: by
    default one per sequence, which the engine keeps first; it adds up to three more a sequence only from budget
    its capped blocks leave unused), from the same terms every layout's plan is built from."""
    info = load(model, FORMAT_TORCH[dtype])
    block_size = block_size_of(info, block_size)
    cfg = PlanConfig(batch=batch, dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=block_size, workspace_slots=1)
    override, workspace, _ = expert_storage(info, cfg)
    costs = model_costs(info, override, workspace, kv_cache_dtype, block_size, FORMAT_TORCH[dtype])
    held = pipeline_stages(len(costs.layers), layout.pp)[stage]
    m = stage_memory(costs, cfg, layout, held, stage == 0, stage == layout.pp - 1, context,
                     min(cfg.prefill_chunk, context))
    # the engine also allocates the null block and the null state slot that padding rows use
    ls = [costs.layers[i] for i in held]
    per_slot = sum(state_bytes(lc, layout.tp) for lc in ls)
    null = block_size * sum(kv_bytes_per_token(lc, layout.tp) for lc in ls) + per_slot  # every pool's null block
    snaps = (batch if snapshots is None else snapshots) * per_slot
    return {"weights": m["weights"] + m["workspace"], "cache": m["kv_cache"] + m["state"] + null + snaps}



def expert_storage(info, cfg: PlanConfig) -> tuple[str | None, str | None, str]:
    """(override of the routed experts' format or None, workspace format or None, description)."""
    declared = expert_format(info)
    override = None if cfg.experts in ("auto", declared) else cfg.experts
    effective = override or declared
    workspace = None
    if effective == "mxfp4" and cfg.conversion != "fused":
        workspace = "bf16" if cfg.conversion == "auto" else cfg.conversion
        if converts_to_tiles(cfg.conversion, cfg.fp8_activations):
            workspace = "fp8_tile"  # e4m3 with one fp32 scale per 128 x 128 tile, multiplied FP8 x FP8
    desc = declared_format(info.spec) if override is None else f"experts {override.upper()} (--experts)"
    if workspace:
        name = "FP8-tile (FP8 activations)" if workspace == "fp8_tile" else workspace.upper()
        article = "an" if name[0] in "AEFHILMNORSX" else "a"  # as the letters are read: an FP8, a BF16
        desc += f"; MXFP4 experts converted into {article} {name} workspace ({cfg.workspace_slots} slot" \
                f"{'s' if cfg.workspace_slots > 1 else ''})"
        if cfg.conversion == "auto":
            desc += f" for steps of more than {FUSED_ROWS_PER_EXPERT} rows per expert, read packed below"
    elif effective == "mxfp4":
        desc += "; MXFP4 experts run by a fused GEMM (no workspace)"
    return override, workspace, desc


def plan(model: str | None, cfg: PlanConfig) -> dict:
    info = load(model, FORMAT_TORCH[cfg.dtype])
    cfg = replace(cfg, block_size=block_size_of(info, cfg.block_size))
    override, workspace, desc = expert_storage(info, cfg)
    costs = model_costs(info, override, workspace, cfg.kv_cache_dtype, cfg.block_size, FORMAT_TORCH[cfg.dtype])
    context = cfg.context or costs.max_position
    budget = (cfg.device.mem_bytes * cfg.memory_fraction) if cfg.device else math.inf
    rows = []
    for lay in layouts(costs, cfg.devices):
        mem = memory(costs, cfg, lay, context)
        total = sum(mem.values())
        row = {"layout": asdict(lay), "name": str(lay), "memory": mem, "total": total, "fits": total <= budget,
               "weights_fit": mem["weights"] + mem["workspace"] <= budget, "engine_gap": engine_gap(lay)}
        if cfg.device is not None:
            row["max_context"] = longest_context(costs, cfg, lay, budget, min(cfg.prefill_chunk, context))
            row.update(roofline(costs, cfg, lay, context))
        rows.append(row)
    rows.sort(key=lambda r: (not r["fits"], -r.get("decode_tokens_per_s", 0), -r.get("prefill_tokens_per_s", 0)))
    fitting = [r for r in rows if r["fits"]]
    return {
        "model": info.name, "devices": cfg.devices, "device": asdict(cfg.device) if cfg.device else None,
        "context": context, "batch": cfg.batch, "kv_cache_dtype": cfg.kv_cache_dtype,
        "kv_cache_dtype_resolved": cfg.kv_cache_dtype if cfg.kv_cache_dtype != "auto" else cfg.dtype,
        "weights_format": desc,
        "budget_bytes": budget, "layouts": rows, "fitting": len(fitting),
        "best": fitting[0] if fitting else None,
        # the best layout the engine runs today (the plan's best may need what is not built yet)
        "best_runnable": next((r for r in fitting if r["engine_gap"] is None), None),
        "longest_context": max((r.get("max_context", 0) for r in rows), default=0),
        "lightest_weights": min(rows, key=lambda r: r["memory"]["weights"] + r["memory"]["workspace"], default=None),
    }


def _row(r: dict) -> list:
    m = r["memory"]
    return [r["name"], fmt.size(m["weights"] + m["workspace"]), fmt.size(m["kv_cache"] + m["state"]),
            fmt.size(m["activations"] + m["indexer_scratch"] + m["moe_dispatch"] + m["comm_buffers"] + m["encoder"]
                     + m["runtime"]),
            fmt.size(r["total"]), "yes" if r["fits"] else "no", fmt.tokens(r.get("max_context", 0)) or "0",
            f"{r.get('decode_tokens_per_s', 0):.1f}", f"{r.get('prefill_tokens_per_s', 0):.0f}",
            r.get("decode_bound", ""), "yes" if r["engine_gap"] is None else "not yet"]


def render(p: dict, top: int = 12) -> str:
    dev = p["device"]
    out = [f"plan: {p['model']} on {p['devices']}×{dev['name']} ({dev['mem_gib']:g} GiB, {dev['tbps']:g} TB/s, "
           f"{dev['tflops']:g} TFLOP/s, link {dev['link_gbps']:g} GB/s); context {fmt.tokens(p['context'])}, "
           f"batch {p['batch']}, kv cache {p['kv_cache_dtype_resolved']}",
           f"weights: {p['weights_format']}",
           f"{p['fitting']} of {len(p['layouts'])} layouts fit in {fmt.size(p['budget_bytes'])} per device "
           f"(decode tokens/s for the whole batch; prefill tokens/s with every DP rank prefilling):"]
    shown = p["layouts"][:top]
    out.append(fmt.table([_row(r) for r in shown], ["layout", "weights", "kv+state", "transient", "total/device",
                                                     "fits", "max ctx", "decode tok/s", "prefill tok/s", "bound",
                                                     "engine"]))
    if len(p["layouts"]) > top:
        out.append(f"  ... {len(p['layouts']) - top} more (--top N, or --json)")
    b = p["best"]
    if b is None:
        out.append(_why_nothing_fits(p))
        return "\n".join(out)
    m = b["memory"]
    out.append(f"best: {b['name']}: decode {b['decode_tokens_per_s']:.1f} tokens/s ({b['decode_step_s'] * 1e3:.1f} ms "
               f"per step, {b['decode_bound']}-bound), prefill {b['prefill_tokens_per_s']:.0f} tokens/s, longest "
               f"context at batch {p['batch']}: {fmt.tokens(b['max_context'])} tokens")
    out.append("  per device: " + ", ".join(f"{k.replace('_', ' ')} {fmt.size(v)}" for k, v in m.items() if v))
    run = p.get("best_runnable")
    if b["engine_gap"] is not None:
        out.append(f"  the engine cannot run it yet: {b['engine_gap']}")
        out.append(f"best the engine runs: {run['name']}: decode {run['decode_tokens_per_s']:.1f} tokens/s, prefill "
                   f"{run['prefill_tokens_per_s']:.0f} tokens/s" if run else "no fitting layout is one the engine runs yet")
    return "\n".join(out)


def _why_nothing_fits(p: dict) -> str:
    light = p["lightest_weights"]
    weights = light["memory"]["weights"] + light["memory"]["workspace"] if light else 0
    if light is not None and weights > p["budget_bytes"]:
        return (f"no layout fits: the weights alone need {fmt.size(weights)} per device even spread as {light['name']}, "
                f"more than the {fmt.size(p['budget_bytes'])} a device may use (--memory-fraction of its memory); "
                f"more devices, or smaller weights (--experts fp8 or mxfp4), would fit them")
    return (f"no layout fits a {fmt.tokens(p['context'])} context at batch {p['batch']}; the longest context any "
            f"layout fits is {fmt.tokens(p['longest_context'])} tokens")


def main(args) -> int:
    custom = [parse_device_spec(s) for s in args.device_spec or []]
    n, kind = parse_devices(args.devices, custom)
    cfg = PlanConfig(
        devices=n, device=kind, context=args.context, batch=args.batch, kv_cache_dtype=args.kv_cache_dtype,
        experts=args.experts, conversion=args.conversion, prefill_chunk=args.prefill_chunk,
        memory_fraction=args.memory_fraction, fp8_activations=args.fp8_activations,
    )
    p = plan(args.model, cfg)
    print(json.dumps(p, indent=1, default=str) if args.json else render(p, args.top))
    return 0 if p["best"] is not None else 1
