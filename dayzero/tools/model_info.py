"""What the tools know about a model before any weight is read.

:func:`load` turns MODEL (a checkpoint directory, a ``config.json``, or nothing for the bundled model) into
its spec and a model built on the meta device. Every parameter is then sorted into a component
(embedding, attention of each kind, routed experts, router, ...) by where it sits in the module tree, so
counts, stored bytes and sharding work for any registered architecture without knowing its name.
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dayzero.config.spec import ModelSpec, MoESpec
from dayzero.models.registry import Adapter, adapter_for, build_model, read_config
from dayzero.multimodal.families import vision_family

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "assets" / "default"

# component names, in display order; attention components carry their kind: "attention.kda"
EMBEDDING, LM_HEAD, NORMS, DENSE_MLP = "embedding", "lm_head", "norms", "dense_mlp"
ROUTER, ROUTED, SHARED, LATENT, OTHER = "router", "experts_routed", "experts_shared", "moe_latent", "other"
VISION = "vision_tower"  # the image encoder of a vision-language checkpoint (``visual.*``)
ORDER = (VISION, EMBEDDING, "attention", NORMS, DENSE_MLP, ROUTER, ROUTED, SHARED, LATENT, OTHER, LM_HEAD)
_ROUTED_LEAF = re.compile(r"(w1|w2|b1|b2)(_\w+)?$")

# bits per weight of each stored format (MXFP4: 4-bit elements + one 8-bit scale per 32; the fp8 expert
# workspace: e4m3 codes + one fp32 scale per 32)
FORMAT_BITS = {"fp32": 32, "bf16": 16, "fp16": 16, "fp8": 8, "mxfp4": 4.25, "fp8_ws": 9}
TORCH_FORMAT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
FORMAT_TORCH = {v: k for k, v in TORCH_FORMAT.items()}


@dataclass(frozen=True)
class Param:
    name: str
    layer: int | None  # decoder layer index, None outside the layers
    component: str  # one of ORDER, attention ones as "attention.<kind>"
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def kind(self) -> str:
        """"weight"; "mxfp4" for packed E2M1 codes (two weights a byte); "scale" for quantisation scales."""
        if self.dtype == torch.uint8 and re.search(r"[._]blocks$", self.name):
            return "mxfp4"
        if re.search(r"([._]scales|scale_inv|_scale)$", self.name):
            return "scale"
        return "weight"

    @property
    def logical_shape(self) -> tuple[int, ...]:
        """The weight's shape as a matrix of numbers: packed MXFP4 [.., N, K/32, 16] is [.., N, K]."""
        if self.kind == "mxfp4":
            return (*self.shape[:-2], self.shape[-2] * self.shape[-1] * 2)
        return self.shape

    @property
    def logical(self) -> int:
        """Model parameters this tensor holds (scales are metadata, not parameters)."""
        return 0 if self.kind == "scale" else math.prod(self.logical_shape)

    @property
    def is_bias(self) -> bool:
        leaf = self.name.rsplit(".", 1)[-1]
        return "bias" in leaf or leaf in ("b1", "b2")

    @property
    def label(self) -> str:
        return stored_label(self.name, self.dtype)


_LABELS = {
    torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
    torch.float8_e4m3fn: "FP8", torch.float8_e5m2: "FP8-E5M2",
}


def stored_label(name: str, dtype: torch.dtype) -> str:
    """The storage format of a tensor: MXFP4 codes and scales are uint8 tensors so named, and block-FP8
    scales (``*scale_inv``) belong to their FP8 weights."""
    if dtype == torch.uint8 and re.search(r"[._](blocks|scales)$", name):
        return "MXFP4"
    if name.endswith("scale_inv"):
        return "FP8"
    return _LABELS.get(dtype, str(dtype).removeprefix("torch.").upper())


@dataclass
class ModelInfo:
    source: Path  # what MODEL named
    config_file: Path
    raw: dict
    adapter: Adapter
    spec: ModelSpec
    model: torch.nn.Module  # on the meta device
    checkpoint: Path | None  # the directory, when it holds safetensors files
    params: list[Param] = field(default_factory=list)
    tower: torch.nn.Module | None = None  # the vision tower on the meta device, for a vision-language checkpoint

    @property
    def name(self) -> str:
        return self.source.name if self.source.is_dir() else self.source.stem

    def layer_params(self, i: int) -> list[Param]:
        return [p for p in self.params if p.layer == i]


def component_of(spec: ModelSpec, name: str) -> tuple[int | None, str]:
    """(layer index, component) of a parameter name of :class:`~dayzero.models.decoder.CausalLM`."""
    if name.startswith("model.embed_tokens."):
        return None, EMBEDDING
    if name.startswith("lm_head."):
        return None, LM_HEAD
    m = re.match(r"model\.layers\.(\d+)\.(.+)", name)
    if m is None:
        return None, NORMS if "norm" in name else OTHER
    i, rest = int(m.group(1)), m.group(2)
    layer = spec.layers[i]
    if rest.startswith("self_attn."):
        return i, f"attention.{layer.attn_kind or 'mixer'}"
    if rest.startswith("mlp."):
        if not isinstance(layer.mlp, MoESpec):
            return i, DENSE_MLP
        sub = rest[len("mlp."):]
        head = sub.split(".", 1)[0]
        if _ROUTED_LEAF.fullmatch(head) or head == "experts":
            return i, ROUTED
        if head.startswith("shared_expert"):
            return i, SHARED
        if head in ("gate", "router", "e_score_correction_bias", "tid2eid"):
            return i, ROUTER
        return i, LATENT
    return i, NORMS if "norm" in rest else OTHER


def _checkpoint_dir(path: Path) -> Path | None:
    if path.is_dir() and (any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").exists()):
        return path
    return None


def load(model: str | Path | None = None, dtype: torch.dtype | None = None) -> ModelInfo:
    """Read MODEL's config and build it on the meta device (no memory, no weights read)."""
    source = Path(model) if model else DEFAULT_MODEL
    raw, config_file = read_config(source)
    adapter = adapter_for(raw, config_file)
    spec = adapter.to_spec(raw)
    meta = build_model(spec, dtype or spec.dtype, "meta")
    info = ModelInfo(source, config_file, raw, adapter, spec, meta, _checkpoint_dir(source))
    for name, p in meta.named_parameters():  # tied weights appear once
        layer, comp = component_of(spec, name)
        info.params.append(Param(name, layer, comp, tuple(p.shape), p.dtype))
    family = vision_family(raw)
    if family is not None:  # the engine attaches it as ``visual`` in the model's dtype
        with torch.device("meta"):
            info.tower = family.build(raw)
        for name, p in info.tower.named_parameters():
            info.params.append(Param(f"visual.{name}", None, VISION, tuple(p.shape), dtype or spec.dtype))
    return info


# --- parameter counts --------------------------------------------------------------------------------
def moe_fraction(spec: ModelSpec, layer: int | None) -> float:
    """Share of a layer's routed-expert parameters one token uses: top_k / n_experts."""
    mlp = spec.layers[layer].mlp if layer is not None else None
    return mlp.top_k / mlp.n_experts if isinstance(mlp, MoESpec) and mlp.n_experts else 1.0


def count_params(info: ModelInfo) -> dict:
    """Totals and per-token active counts, by component."""
    total, active = defaultdict(int), defaultdict(float)
    for p in info.params:
        total[p.component] += p.logical
        active[p.component] += p.logical * (moe_fraction(info.spec, p.layer) if p.component == ROUTED else 1.0)
    n_total, n_active = sum(total.values()), sum(active.values())
    emb, head = total.get(EMBEDDING, 0), total.get(LM_HEAD, 0)
    return {
        "by_component": {c: {"total": total[c], "active": round(active[c])} for c in sorted(total, key=_order)},
        "params_total": n_total,
        "params_active": round(n_active),
        "params_active_excl_embeddings": round(n_active - emb - head),
        "params_active_excl_input_embedding": round(n_active - emb),
        "params_total_excl_embeddings": n_total - emb - head,
    }


def _order(component: str) -> tuple[int, str]:
    base = component.split(".", 1)[0]
    return (ORDER.index(base) if base in ORDER else len(ORDER), component)


# --- weights as stored -------------------------------------------------------------------------------
def declared_format(spec: ModelSpec) -> str:
    """How the config says weights are stored: routed experts, and the other linear layers."""
    experts = {getattr(l.mlp, "expert_format", "dense") for l in spec.layers if isinstance(l.mlp, MoESpec)}
    linear = getattr(spec, "linear_format", "dense")
    names = {"dense": spec.torch_dtype, "mxfp4": "MXFP4", "fp8_block": "block FP8 (128x128 tiles)"}
    parts = [f"experts {', '.join(names.get(e, e) for e in sorted(experts))}"] if experts else []
    parts.append(f"other matrices {names.get(linear, linear)}")
    return ", ".join(parts)


def format_bytes(shape: tuple[int, ...], fmt: str, block: tuple[int, int] = (128, 128)) -> float:
    """Bytes of a weight of ``shape`` stored as ``fmt`` (fp8 with one fp32 scale per ``block`` tile)."""
    n = math.prod(shape)
    if fmt == "fp8" and len(shape) >= 2:
        tiles = math.prod(shape[:-2]) * math.ceil(shape[-2] / block[0]) * math.ceil(shape[-1] / block[1])
        return n + 4 * tiles
    return n * FORMAT_BITS[fmt] / 8


def stored_bytes(info: ModelInfo) -> dict[str, dict[str, int]]:
    """format -> component -> bytes of the model's tensors as built from the config (quantised formats the
    config declares are built as such, so these are the bytes a matching checkpoint holds)."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for p in info.params:
        out[p.label][p.component] += p.nbytes
    return {k: dict(v) for k, v in out.items()}


# --- caches ------------------------------------------------------------------------------------------
def paged_bytes_per_token(spec, kv_cache_dtype: str = "auto", block_size: int = 16) -> float:
    """Bytes per token of a paged cache spec in ``kv_cache_dtype`` (quantised pools with their scales)."""
    return spec.bytes_per_token(kv_cache_dtype, block_size)


def block_size_of(info: ModelInfo, block_size: int | None = None) -> int:
    """``block_size``, or the one the engine takes when none is given (``cache.planner.auto_block_size``)."""
    from dayzero.cache.planner import auto_block_size

    return block_size or auto_block_size([s for _, _, s in cache_specs(info)])


def cache_specs(info: ModelInfo, dtype: torch.dtype | None = None):
    """(layer index, attention kind, cache spec) of every layer that keeps a cache."""
    from dayzero.cache.spec import PagedSpec, StateSpec, parts

    dtype = dtype or info.spec.dtype
    out = []
    for i, mod in info.model.cached_layers():  # the layers the engine allocates caches for
        try:
            specs = parts(mod.cache_spec(dtype))
        except NotImplementedError:
            continue
        out += [(i, info.spec.layers[i].attn_kind or "mixer", s) for s in specs if isinstance(s, (PagedSpec, StateSpec))]
    return out
