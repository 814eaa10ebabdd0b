"""The command line and the bundled default model."""
from __future__ import annotations

import subprocess
import sys

from dayzero import LLM, SamplingParams


def test_generate_cli_on_a_checkpoint(tiny_ckpt):
    r = subprocess.run(
        [sys.executable, "-m", "dayzero.cli", "generate", "--model", str(tiny_ckpt), "Hello", "--max-tokens", "5",
         "--ignore-eos", "--device", "cpu"],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Hello")
    assert "5 tokens" in r.stderr and "finish_reason=length" in r.stderr


def test_generate_cli_rejects_bad_sampling_value():
    r = subprocess.run([sys.executable, "-m", "dayzero.cli", "generate", "x", "--temperature", "-1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "temperature" in r.stderr


def test_bundled_default_model_loads_with_no_arguments():
    llm = LLM(device="cpu")
    cfg = llm.engine.model_config
    assert cfg.model_type == "dayzero_hybrid" and {"kda", "dsa"} <= set(cfg.layer_types)
    moe = [l.mlp for l in cfg.layers if l.mlp_kind == "moe"]
    assert moe and all(m.latent_size and m.n_experts > 1 for m in moe)
    out = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 8
    assert llm.tokenizer.decode(out.prompt_token_ids) == "The quick brown fox"
