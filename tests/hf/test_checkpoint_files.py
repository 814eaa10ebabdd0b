"""A Hugging Face checkpoint's own tokenizer, chat template and generation config are what dayzero uses."""
from __future__ import annotations

import json
import shutil

from dayzero import LLM, SamplingParams
from dayzero.engine.engine import DEFAULT_MODEL
from tests.hf.harness import make_hf_checkpoint
from tests.hf.test_moe_families import COMMON, FAMILIES


def test_tokenizer_chat_template_and_generation_config_come_from_the_checkpoint(tmp_path):
    make_hf_checkpoint(tmp_path, "deepseek_v3", **COMMON, **FAMILIES["deepseek_v3"])
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(DEFAULT_MODEL / f, tmp_path / f)
    template = (tmp_path / "chat_template.jinja").read_text()
    (tmp_path / "chat_template.jinja").write_text("[custom]" + template)
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    gen["eos_token_id"] = [257, 42]
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))

    llm = LLM(str(tmp_path), device="cpu", dtype="float32", num_cache_blocks=32)
    assert llm.engine.eos_ids == (257, 42)
    msgs = [{"role": "user", "content": "héllo"}]
    out = llm.chat(msgs, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert out.prompt.startswith("[custom]") and "<|user|>héllo<|end|><|assistant|>" in out.prompt
    assert llm.tokenizer.decode(out.prompt_token_ids) == out.prompt
    # an EOS id from generation_config.json ends generation
    free = llm.generate([{"prompt_token_ids": [7, 8, 9]}], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    first = free.outputs[0].token_ids[3]
    llm.engine.eos_ids = (first,)
    stop = llm.generate([{"prompt_token_ids": [7, 8, 9]}], SamplingParams(max_tokens=12, temperature=0.0))[0].outputs[0]
    assert stop.finish_reason == "stop" and stop.token_ids[-1] == first
