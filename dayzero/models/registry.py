"""Architectures by ``model_type``, and building a model on a device in a dtype."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from dayzero.config.model_config import HybridConfig
from dayzero.models.hybrid import HybridForCausalLM

ARCHITECTURES = {"dayzero_hybrid": (HybridConfig, HybridForCausalLM)}


def load_config(path: str | Path):
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.exists():
        raise FileNotFoundError(f"no config.json at {path}")
    with open(file) as f:
        raw = json.load(f)
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"{file}: unknown model_type {model_type!r}; supported: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[model_type][0].from_dict(raw)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def build_model(cfg, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The model with uninitialised weights, built directly on ``device`` (``"meta"`` reads nothing).
    Parameters that must stay fp32 (router, gates' A_log/dt_bias, indexer weights_proj) say so themselves."""
    cls = ARCHITECTURES[cfg.model_type][1]
    with torch.device(device), default_dtype(dtype):
        return cls(cfg).eval()
