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


# Without a GPU, every kernel the interpreter runs is also compiled for sm90 at the session's end (the interpreter
# runs kernels the compiler refuses): tests/triton_compile.py.
def pytest_configure(config):
    if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("DAYZERO_TRITON_COMPILE") == "0":
        return
    try:
        from tests import triton_compile

        triton_compile.install()
    except ImportError:  # no triton: nothing is interpreted
        return
    config._dayzero_triton_compile = triton_compile


def pytest_sessionfinish(session, exitstatus):
    check = getattr(session.config, "_dayzero_triton_compile", None)
    if check is None or not check.recorded():
        return
    rc, report = check.check()
    terminal = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = [f"not compiled: {k} ({why})" for k, why in sorted(check.unmodelled.items())]
    for line in ["", *report.rstrip().splitlines(), *skipped]:
        terminal.write_line(line) if terminal else print(line)
    if rc:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
