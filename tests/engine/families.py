"""The architecture families that decode through the batch-wide ops, as tiny configs (random weights are
drawn at load with ``load_format="dummy"``), and prompts for them."""
from __future__ import annotations

import torch

FAMILIES = ["dayzero_hybrid", "deepseek_v32", "kimi_linear", "qwen3_next", "deepseek_v4"]


def hf_config(name: str) -> dict:
    if name == "deepseek_v32":
        from tests.hf.test_dsa_families import COMMON, FAMILIES as DSA
        return {**COMMON, **DSA[name], "model_type": name}
    if name in ("kimi_linear", "qwen3_next"):
        from tests.hf.test_linear_families import COMMON, FAMILIES as LINEAR
        return {**COMMON, **LINEAR[name], "model_type": name}
    if name == "nemotron_h":
        from tests.hf.test_nemotron_h import CONFIG
    elif name == "gpt_oss":
        from tests.hf.test_gpt_oss import CONFIG
    else:
        from tests.hf.test_deepseek_v4 import CONFIG
    return {**CONFIG, "model_type": name}


def prompts(n: int, vocab: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    lens = [3, 17, 6, 29, 9, 1, 12, 21][:n]
    return [{"prompt_token_ids": torch.randint(3, vocab, (k,), generator=g).tolist()} for k in lens]
