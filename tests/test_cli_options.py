"""Every engine option reachable from the command line and from ``LLM()`` under the same name; the command
line's conventions (--version, ``python -m dayzero``, defaults in every help, global flags anywhere)."""
from __future__ import annotations

import argparse
import inspect
import subprocess
import sys
from dataclasses import fields

import pytest

import dayzero
from dayzero import LLM, cli
from dayzero.engine.engine import EngineConfig
from dayzero.tools.cli_options import Help, byte_size, engine_kwargs

ENGINE_FIELDS = {f.name for f in fields(EngineConfig)}


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_llm_takes_every_engine_option():
    params = set(inspect.signature(LLM.__init__).parameters) - {"self"}
    assert ENGINE_FIELDS <= params, ENGINE_FIELDS - params


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_generate_and_serve_take_every_engine_option(command):
    dests = {a.dest for a in _commands()[command]._actions}
    assert ENGINE_FIELDS <= dests, ENGINE_FIELDS - dests


def test_engine_options_reach_llm(monkeypatch, capsys):
    got = {}

    class Stop(Exception):
        pass

    def fake_llm(**kwargs):
        got.update(kwargs)
        raise Stop

    monkeypatch.setattr(dayzero, "LLM", fake_llm)
    argv = ["generate", "hi", "--device", "cpu", "--dtype", "bfloat16", "--threads", "1", "--load-format", "dummy",
            "--seed", "7", "--max-num-seqs", "3", "--max-model-len", "99", "--max-num-batched-tokens", "64",
            "--block-size", "8", "--num-cache-blocks", "40", "--cache-memory-bytes", "1.5GiB",
            "--cache-memory-fraction", "0.25", "--kv-cache-dtype", "int8", "--index-cache-dtype", "fp8",
            "--expert-compute", "fp8", "--fp8-activations",
            "--high-precision-layers", "0", "2", "--enforce-eager", "--cuda-graph-sizes", "1", "4",
            "--cuda-graph-max-len", "512", "--cuda-graph-prefill-tokens", "256", "--no-enable-prefix-caching", "--prefix-snapshot-interval", "256",
            "--num-prefix-snapshots", "5", "--prefix-eviction-policy", "lru", "--async-scheduling", "--host-cache-gib", "1.5", "--tp", "2", "--ep", "2",
            "--pp", "2", "--dp", "3", "--pp-micro-batches", "3", "--num-redundant-experts", "4", "--eplb-interval", "100",
            "--distributed-host", "10.0.0.1", "--distributed-port", "29555"]
    assert cli.main(argv) == 1  # the fake LLM stops the run
    assert got == {"model": None, "device": "cpu", "dtype": "bfloat16", "num_threads": 1, "load_format": "dummy",
                   "seed": 7, "max_num_seqs": 3, "max_model_len": 99, "max_num_batched_tokens": 64,
                   "block_size": 8, "num_cache_blocks": 40, "cache_memory_bytes": 3 * 2**29,
                   "cache_memory_fraction": 0.25, "kv_cache_dtype": "int8", "index_cache_dtype": "fp8", "fp8_activations": True,
                   "expert_compute": "fp8",
                   "high_precision_layers": [0, 2], "enforce_eager": True, "cuda_graph_sizes": [1, 4],
                   "cuda_graph_max_len": 512, "cuda_graph_prefill_tokens": 256, "enable_prefix_caching": False, "prefix_snapshot_interval": 256,
                   "num_prefix_snapshots": 5, "prefix_eviction_policy": "lru", "async_scheduling": True, "host_cache_gib": 1.5, "tp": 2, "ep": 2,
                   "pp": 2, "dp": 3, "pp_micro_batches": 3, "num_redundant_experts": 4, "eplb_interval": 100,
                   "distributed_host": "10.0.0.1", "distributed_port": 29555}


def test_generate_runs_with_engine_options(tiny_ckpt, capsys):
    rc = cli.main(["generate", "--model", str(tiny_ckpt), "Hello", "--max-tokens", "3", "--ignore-eos", "--device", "cpu",
                   "--kv-cache-dtype", "int8", "--block-size", "8", "--num-cache-blocks", "32", "--max-model-len", "64",
                   "--threads", "1"])
    out = capsys.readouterr()
    assert rc == 0 and out.out.startswith("Hello") and "3 tokens" in out.err, out.err


def test_serve_hands_the_launcher_the_engine_config(monkeypatch):
    got = []
    monkeypatch.setattr("dayzero.server.launcher.serve", lambda args: got.append(args) or 0)
    assert cli.main(["serve", "--kv-cache-dtype", "fp8", "--threads", "2", "--cache-memory-bytes", "512MiB"]) == 0
    cfg = got[0].engine_config
    assert set(cfg) == ENGINE_FIELDS and EngineConfig(**cfg).kv_cache_dtype == "fp8"
    assert (cfg["num_threads"], cfg["cache_memory_bytes"]) == (2, 512 * 2**20)
    assert engine_kwargs(got[0]) == cfg


def test_byte_sizes():
    assert [byte_size(t) for t in ("1073741824", "8GiB", "512 MiB", "2.5GB", "1e3")] == [2**30, 8 * 2**30, 2**29,
                                                                                         2_500_000_000, 1000]
    for bad in ("0", "-1GiB", "8 parsecs", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            byte_size(bad)


def test_every_option_is_described_with_its_default():
    for name, parser in _commands().items():
        fmt = Help(prog=name)
        for a in parser._actions:
            if isinstance(a, (argparse._HelpAction, argparse._VersionAction)):
                continue
            assert a.help, (name, a.dest)
            shown = a.default is not None and a.default is not False and a.default != () and a.default != argparse.SUPPRESS
            if shown:
                assert "(default" in fmt._get_help_string(a), (name, a.dest)
        assert "(default: " in parser.format_help(), name


def test_global_flags_before_or_after_the_command():
    p = cli.build_parser()
    assert p.parse_args(["-v", "inspect"]).verbose and p.parse_args(["inspect", "-v"]).verbose
    assert p.parse_args(["inspect", "--debug"]).debug and not p.parse_args(["inspect"]).verbose
    assert p.parse_args(["--debug", "ops", "-v"]).debug


def test_version_and_python_dash_m(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"dayzero {dayzero.__version__}"
    r = subprocess.run([sys.executable, "-m", "dayzero", "--version"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == f"dayzero {dayzero.__version__}"
    r = subprocess.run([sys.executable, "-m", "dayzero", "ops", "--platform", "cdua"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2 and r.stderr.startswith("error: unknown platform 'cdua'")
