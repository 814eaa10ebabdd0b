from __future__ import annotations

import json

import pytest
import torch

from dayzero.ops import registry, triton_support
from tests.engine.families import FAMILIES, hf_config


@pytest.fixture(params=FAMILIES)
def model_dir(request, tmp_path, tiny_ckpt) -> str:
    """A checkpoint directory of each family: the tiny hybrid with its weights, or a config for dummy weights."""
    if request.param == "dayzero_hybrid":
        return str(tiny_ckpt)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(request.param)))
    return str(tmp_path)


@pytest.fixture
def cuda_ops_on_cpu(monkeypatch):
    """A call that has the registry choose every op's device (``cuda``) implementation, its verifier included, for
    CPU tensors from then on: the device kernels run through Triton's interpreter (``tests/conftest.py`` turns it on
    without a GPU). Skips on a GPU machine, where the interpreter is off and CPU tensors cannot reach the compiled
    kernels (the device paths run on the device there: ``test_cuda_graphs.py`` and the ops' own tests)."""
    if torch.cuda.is_available() and not triton_support.INTERPRET:
        pytest.skip("runs the device kernels on CPU tensors through Triton's interpreter, which is off on a GPU "
                    "machine")
    return lambda: monkeypatch.setattr(registry, "platform_of", lambda device: "cuda")
