"""Shared fixtures: tiny random checkpoints written at test time."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import torch

# Without a GPU, the Triton kernels are tested through Triton's interpreter (read when triton is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# per-shape kernel choices measured by the tests go to a table of their own, not the user's
if "DAYZERO_CACHE_DIR" not in os.environ:
    os.environ["DAYZERO_CACHE_DIR"] = tempfile.mkdtemp(prefix="dayzero-test-cache-")
    atexit.register(shutil.rmtree, os.environ["DAYZERO_CACHE_DIR"], ignore_errors=True)

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from dayzero.tools.build_default_model import build_checkpoint  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def tiny_config(**overrides) -> dict:
    with open(CONFIGS / "dayzero-tiny.json") as f:
        cfg = json.load(f)
    cfg.update(overrides)
    return cfg


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """The tiny hybrid model (KDA + gated DSA + GQA, LatentMoE with shared experts), random weights, with tokenizer."""
    return build_checkpoint(tmp_path_factory.mktemp("tiny"), tiny_config(), seed=1)


@pytest.fixture(scope="session")
def tiny_ckpt_no_tokenizer(tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tiny-notok"), tiny_config(), seed=2, tokenizer=False)
