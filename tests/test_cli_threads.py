"""CPU threads: asked for (``--threads``, ``num_threads``), or fewer than torch's own count when other
processes load the machine; the choice is logged at start-up."""
from __future__ import annotations

import logging

import pytest
import torch

from dayzero import LLM
from dayzero.cli import build_parser
from dayzero.engine import device
from dayzero.engine.device import configure_threads
from dayzero.engine.engine import EngineConfig
from tests.conftest import CONFIGS

TINY = str(CONFIGS / "dayzero-tiny.json")


@pytest.fixture
def four_cores(monkeypatch):
    """A 4-core machine whose load average the test sets; torch's threads restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(4)
    monkeypatch.setattr(device, "_usable_cores", lambda: 4)
    load = [0.0]
    monkeypatch.setattr(device.os, "getloadavg", lambda: (load[0], 0.0, 0.0))
    yield load
    torch.set_num_threads(n)


@pytest.mark.parametrize("load,threads", [(0.1, 4), (0.6, 3), (1.6, 2), (2.5, 2), (3.9, 1), (12.0, 1)])
def test_loaded_machine_gets_the_free_cores(four_cores, load, threads, caplog):
    four_cores[0] = load
    with caplog.at_level(logging.INFO, logger="dayzero"):
        assert configure_threads() == threads
    assert torch.get_num_threads() == threads
    assert f"cpu threads: {threads} (" in caplog.text and f"{load:.2f}" in caplog.text


def test_asked_for_wins_and_never_more_than_torch_unasked(four_cores, caplog):
    four_cores[0] = 3.9
    with caplog.at_level(logging.INFO, logger="dayzero"):
        assert configure_threads(3) == 3
    assert "cpu threads: 3 (as asked)" in caplog.text
    four_cores[0] = 0.0
    torch.set_num_threads(2)  # set by the user before: an idle machine does not raise it
    assert configure_threads() == 2


def test_engine_config_and_llm_take_num_threads(four_cores):
    with pytest.raises(ValueError, match="num_threads must be a positive int"):
        EngineConfig(num_threads=0)
    llm = LLM(TINY, load_format="dummy", device="cpu", num_threads=1)
    assert llm.engine.num_threads == 1 and torch.get_num_threads() == 1


@pytest.mark.parametrize("argv", [["generate", "hi"], ["serve"], ["ops"], ["profile"], ["align"]], ids=lambda a: a[0])
def test_threads_on_every_command_that_runs_a_model(argv):
    p = build_parser()
    assert p.parse_args([*argv, "--threads", "3"]).num_threads == 3
    assert p.parse_args([*argv, "--num-threads", "2"]).num_threads == 2
    assert p.parse_args(argv).num_threads is None
