from __future__ import annotations

import json

import pytest

from tests.engine.families import FAMILIES, hf_config


@pytest.fixture(params=FAMILIES)
def model_dir(request, tmp_path, tiny_ckpt) -> str:
    """A checkpoint directory of each family: the tiny hybrid with its weights, or a config for dummy weights."""
    if request.param == "dayzero_hybrid":
        return str(tiny_ckpt)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(request.param)))
    return str(tmp_path)
