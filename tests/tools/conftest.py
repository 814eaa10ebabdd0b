"""Helpers for the tool tests: a config written to a temporary directory."""
from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture
def write_config(tmp_path):
    def write(cfg: dict, name: str = "model") -> Path:
        d = tmp_path / name
        d.mkdir(exist_ok=True)
        (d / "config.json").write_text(json.dumps(cfg))
        return d

    return write
