"""Architectures by ``model_type``: each maps a ``config.json`` onto a :class:`ModelSpec` and gives the
checkpoint name table its weights load by."""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from dayzero.config.spec import ModelSpec
from dayzero.distributed import SINGLE, ParallelState
from dayzero.loader.rules import Rule, identity_rules
from dayzero.models.decoder import CausalLM


@dataclass(frozen=True)
class Adapter:
    model_type: str
    to_spec: Callable[[dict], ModelSpec]
    rules: Callable[[ModelSpec], list[Rule]] = lambda spec: identity_rules()
    ignore: tuple[str, ...] = ()  # checkpoint tensors that are known and deliberately not loaded
    notes: str = ""
    aliases: tuple[str, ...] = field(default=())


ARCHITECTURES: dict[str, Adapter] = {}


def register(adapter: Adapter) -> Adapter:
    for name in (adapter.model_type, *adapter.aliases):
        ARCHITECTURES[name] = adapter
    return adapter


def _native_spec(raw: dict) -> ModelSpec:
    from dayzero.config.model_config import HybridConfig

    return HybridConfig.from_dict(raw).to_spec()


register(Adapter("dayzero_hybrid", _native_spec, notes="native KDA + gated DSA + GQA, dense or (Latent)MoE"))


def _load_adapters() -> None:
    # importing the adapter modules registers them
    from dayzero.models import adapters  # noqa: F401


def read_config(path: str | Path) -> tuple[dict, Path]:
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise FileNotFoundError(f"no config.json at {path}")
    with open(file) as f:
        return json.load(f), file


def adapter_for(raw: dict, file: Path | str = "config.json") -> Adapter:
    _load_adapters()
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"{file}: unknown model_type {model_type!r}; supported: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[model_type]


def load_config(path: str | Path) -> ModelSpec:
    raw, file = read_config(path)
    return adapter_for(raw, file).to_spec(raw)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def build_model(spec: ModelSpec, dtype: torch.dtype, device: torch.device | str = "cpu",
                parallel: ParallelState = SINGLE) -> CausalLM:
    """The model with uninitialised weights, built directly on ``device`` (``"meta"`` reads nothing), holding
    this rank's slices under ``parallel`` (an impossible layout raises ``ValueError`` naming the setting).
    Parameters that must stay fp32 (router, A_log/dt_bias, indexer weights_proj, sinks) say so themselves."""
    with torch.device(device), default_dtype(dtype):
        model = CausalLM(spec, parallel).eval()
        if spec.linear_format == "fp8_block":
            from dayzero.layers.fp8_linear import convert_linears_to_fp8

            convert_linears_to_fp8(model, spec.linear_exclude)
        return model
