"""Build a random-weight ``dayzero_hybrid`` checkpoint with a byte-level tokenizer.

``python -m dayzero.tools.build_default_model --out DIR`` writes the random-weight model of the bundled family
(``configs/dayzero-default.json``, deterministic: same seed, same bytes), which was the bundled model until a
trained one (``scripts/train_default.py``) replaced it in ``dayzero/assets/default``. Tests use
:func:`build_checkpoint` to make tiny checkpoints at test time.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dayzero.config.model_config import HybridConfig
from dayzero.models.init import init_random_weights
from dayzero.models.registry import build_model
from dayzero.tools.safetensors_out import write_safetensors

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
BOS_ID, EOS_ID = 256, 257
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _byte_symbols() -> list[str]:
    """The printable stand-in for each byte used by byte-level BPE (printable bytes map to themselves)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def save_byte_tokenizer(path: Path) -> None:
    """A byte-level tokenizer (token id = byte value) with a few special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {sym: i for i, sym in enumerate(_byte_symbols())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def build_checkpoint(path: str | Path, config: dict | HybridConfig, seed: int = 0, tokenizer: bool = True,
                     save_dtype: torch.dtype | None = None, std: float = 0.02) -> Path:
    """Write config.json, model.safetensors (random weights) and, optionally, the byte tokenizer."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = config if isinstance(config, HybridConfig) else HybridConfig.from_dict(config)
    model = init_random_weights(build_model(cfg.to_spec(), torch.float32, "cpu"), seed, std)
    tensors = {}
    for name, p in model.state_dict().items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        keep_fp32 = p.dtype == torch.float32 and save_dtype is not None and _is_high_precision(name)
        tensors[name] = (p if save_dtype is None or keep_fp32 else p.to(save_dtype)).contiguous()
    write_safetensors(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with open(path / "config.json", "w") as f:
        json.dump(cfg.to_dict(), f, indent=2)
    if tokenizer:
        save_byte_tokenizer(path)
        with open(path / "generation_config.json", "w") as f:
            json.dump({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID}, f, indent=2)
    return path


def _is_high_precision(name: str) -> bool:
    return any(k in name for k in ("A_log", "dt_bias", "e_score_correction_bias", "mlp.gate.", "weights_proj"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default=str(CONFIGS / "dayzero-default.json"))
    ap.add_argument("--out", required=True,
                    help="directory to write (the bundled model in dayzero/assets/default is the trained one)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = json.load(f)
    out = build_checkpoint(args.out, cfg, args.seed, save_dtype=torch.bfloat16)
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {out} ({size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
