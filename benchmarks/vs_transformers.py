"""dayzero against Hugging Face transformers in one run, on the same random checkpoint: prefill and decode tokens/s.

    python benchmarks/vs_transformers.py --device cuda --batch 1 32 --prompt-len 512 --decode 32 --json vs_hf.json
    python benchmarks/vs_transformers.py --tiny --device cpu --batch 1 2 --prompt-len 16 --decode 4

For each architecture, transformers builds a random model of about 6B parameters (``--tiny``: a few hundred
thousand) straight on the device, bf16 on a GPU and fp32 on the CPU, with its own initialisation (normal
std 0.02, norms at 1, KDA decays as fla initialises them), and saves it as safetensors. It is
timed, freed, and dayzero loads the saved directory and is timed the same way. Per batch size B: a warm-up
run on other prompts (kernels compiled and tuned for these shapes), then on B random prompts of
``--prompt-len`` tokens a run that makes 1 token (prefill) and one that makes 1 + N (greedy, EOS ignored);
decode tok/s = B·N / (t_full - t_prefill) for transformers, and B·N over the time of dayzero's decode steps
(its step loop times the steps that prefill every prompt apart from the steps after). transformers runs as it comes: ``generate`` with its default
attention, experts implementation and cache; its kimi_linear uses fla's kernels when fla imports.

``same tokens`` counts the leading greedy tokens (first batch size) on which the engines agree; on a random bf16
model the logits are nearly flat, so they part early even when both compute the same thing.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

# DeepSeek-V3.2's YaRN (the tiny deepseek_v32 scales an original 32 positions to 256)
YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
MLA = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
# Both about 6B parameters, 1.8-1.9B active: 24 layers of hidden 2048, the first with a dense MLP, the rest
# 64 experts of width 512, top-8, and a shared expert; 3 KDA : 1 MLA in kimi_linear, DSA in every layer of
# deepseek_v32 (its top-2048 keeps every key of a 512-token prompt: the indexer runs, the attention is dense).
CONFIGS = {
    "kimi_linear": dict(
        vocab_size=163840, hidden_size=2048, num_hidden_layers=24, intermediate_size=8192,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6, mlp_layer_types=["dense"] + ["sparse"] * 23,
        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, **MLA, linear_num_heads=16,
        linear_head_dim=128, moe_intermediate_size=512, num_local_experts=64, num_experts_per_tok=8,
        n_shared_experts=1, n_group=1, topk_group=1,
    ),
    "deepseek_v32": dict(
        vocab_size=129280, hidden_size=2048, num_hidden_layers=24, intermediate_size=8192, first_k_dense_replace=1,
        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=1536, **MLA, moe_intermediate_size=512,
        n_routed_experts=64, num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4,
        index_topk=2048, index_n_heads=64, index_head_dim=128, max_position_embeddings=163840, rope_parameters=YARN,
    ),
}
TINY_COMMON = dict(vocab_size=300, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=96,
                   moe_intermediate_size=24, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
                   kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, pad_token_id=0,
                   bos_token_id=1, eos_token_id=2)
TINY = {
    "kimi_linear": dict(TINY_COMMON, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
                        q_lora_rank=None, linear_num_heads=2, linear_head_dim=16, num_local_experts=8),
    # top-8 keys of up to 16 + decode: the sparse path decides the result
    "deepseek_v32": dict(TINY_COMMON, num_hidden_layers=3, first_k_dense_replace=1, q_lora_rank=32, n_routed_experts=8,
                         index_topk=8, index_n_heads=4, index_head_dim=16, max_position_embeddings=256,
                         rope_parameters={**YARN, "factor": 8.0, "original_max_position_embeddings": 32}),
}
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _params(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def fla_status() -> str:
    try:
        fla = importlib.import_module("fla")
        return f"importable ({getattr(fla, '__version__', 'unknown version')})"
    except Exception as e:  # not installed, or installed but broken against this torch / triton
        return f"not importable ({type(e).__name__}: {e})"


def environment(dev: torch.device) -> dict:
    import transformers
    env = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "python": sys.version.split()[0],
           "torch": torch.__version__, "transformers": transformers.__version__, "fla": fla_status()}
    try:
        env["triton"] = importlib.import_module("triton").__version__
    except Exception:
        env["triton"] = None
    return env


def build_checkpoint(model_type: str, config: dict, path: Path, dev: torch.device, dtype: torch.dtype, phases: dict):
    """transformers' own random ``model_type`` model on ``dev``, saved to ``path``; returns (model, parameters)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    t = time.perf_counter()
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **config)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    _sync(dev)
    n = sum(p.numel() for p in model.parameters())
    phases["build_s"] = time.perf_counter() - t
    log(f"{model_type}: {_params(n)} parameters built by transformers in {phases['build_s']:.1f}s")
    t = time.perf_counter()
    model.save_pretrained(str(path))
    phases["save_s"] = time.perf_counter() - t
    log(f"{model_type}: saved in {phases['save_s']:.1f}s")
    return model, n


def measure(run, dev: torch.device, vocab: int, batch: int, prompt_len: int, decode: int, repeat: int) -> dict:
    """``run(prompts, new_tokens)`` generates greedily and returns the first sequence's new token ids, or
    (ids, prefill seconds, decode seconds) when the engine times its own phases (dayzero: its step loop).
    Each run is timed ``repeat`` times and its fastest time kept."""
    g = torch.Generator().manual_seed(batch)  # the same prompts for both engines
    warm, prompts = (torch.randint(3, vocab, (batch, prompt_len), generator=g).tolist() for _ in range(2))
    run(warm, 2)

    def timed(new):
        best, out = (float("inf"),) * 3, None
        for _ in range(repeat):
            _sync(dev)
            t = time.perf_counter()
            out = run(prompts, new)
            _sync(dev)
            wall = time.perf_counter() - t
            phases = out[1:] if isinstance(out, tuple) else (None, None)
            if wall < best[0]:
                best = (wall, *phases)
        return best, (out[0] if isinstance(out, tuple) else out)

    (prefill_s, _, _), _ = timed(1)
    (full_s, own_prefill, own_decode), tokens = timed(1 + decode)
    if own_decode is not None:  # the engine's own phase times: no subtraction of two noisy runs
        prefill_s, decode_tok_s = own_prefill, batch * decode / own_decode
    else:  # a full run no slower than the prefill alone is noise (a busy host), not a decode speed
        decode_tok_s = batch * decode / (full_s - prefill_s) if full_s > prefill_s else None
    return {"prefill_s": prefill_s, "full_s": full_s, "prefill_tok_s": batch * prompt_len / prefill_s,
            "decode_tok_s": decode_tok_s, "tokens": list(tokens)}


def hf_runner(model, dev: torch.device):
    def run(prompts, new):
        ids = torch.tensor(prompts, device=dev)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0)
        return out[0, ids.shape[1]:].tolist()
    return run


def dayzero_runner(llm, dev: torch.device):
    """Through the engine's step loop (``engine_throughput.timed``): the steps that prefill every prompt and the
    decode steps after them are timed apart."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engine_throughput import timed

    def run(prompts, new):
        prefill_s, decode_s, _, seqs = timed(llm.engine, prompts, new - 1, dev)
        return seqs[0].output_ids, prefill_s, decode_s
    return run


def time_engine(name: str, arch: str, make_run, args, dev: torch.device, vocab: int, phases: dict) -> dict:
    """{batch: measure(...)} for one engine, built by ``make_run``; on a failure "error" says why, and the
    batch sizes measured before it stay."""
    t, res = time.perf_counter(), {}
    try:
        run, info = make_run()
        phases[f"{name}_setup_s"] = time.perf_counter() - t
        log(f"{arch}: {name} ready in {phases[f'{name}_setup_s']:.1f}s {info}")
        for bsz in args.batch:
            res[bsz] = r = measure(run, dev, vocab, bsz, args.prompt_len, args.decode, args.repeat)
            log(f"{arch}: {name} batch {bsz}: prefill {r['prefill_s']:.2f}s ({r['prefill_tok_s']:.0f} tok/s), "
                f"1 + {args.decode} tokens {r['full_s']:.2f}s (decode {_fmt(r['decode_tok_s'], '.1f')} tok/s)")
    except Exception as e:  # one engine failing on one architecture must not end the run
        res["error"] = f"{type(e).__name__}: {e}"
        log(f"{arch}: {name} failed: {res['error']}")
    phases[f"{name}_s"] = time.perf_counter() - t
    return res


def bench_arch(arch: str, args, dev: torch.device, dtype: torch.dtype, root: Path) -> dict:
    from dayzero import LLM

    config = (TINY if args.tiny else CONFIGS)[arch]
    path = root / arch
    phases: dict = {}
    entry = {"arch": arch, "config": config, "phases": phases}
    try:
        model, entry["parameters"] = build_checkpoint(arch, config, path, dev, dtype, phases)
    except Exception as e:  # no transformers implementation, or one this config does not fit
        entry["error"] = f"transformers cannot build {arch}: {type(e).__name__}: {e}"
        log(entry["error"])
        return entry

    def make_hf():
        with torch.no_grad():
            ids = torch.randint(3, config["vocab_size"], (1, min(args.prompt_len, 64)), device=dev)
            entry["finite_logits"] = bool(torch.isfinite(model(ids).logits).all())
        impl = {k: getattr(model.config, f"_{k}_implementation", None) for k in ("attn", "experts")}
        entry["transformers_impl"] = impl
        return hf_runner(model, dev), f"(attention {impl['attn']}, experts {impl['experts']}, " \
                                      f"finite logits {entry['finite_logits']})"

    entry["transformers"] = time_engine("transformers", arch, make_hf, args, dev, config["vocab_size"], phases)
    del model, make_hf
    _free(dev)

    def make_dz():
        llm = LLM(str(path), device=dev.type, dtype=str(dtype).removeprefix("torch."), max_num_seqs=max(args.batch),
                  max_num_batched_tokens=max(args.batch) * args.prompt_len, max_model_len=args.prompt_len + args.decode + 1)
        return dayzero_runner(llm, dev), f"({llm.engine.cache_plan.num_blocks} cache blocks; decode: {llm.engine.decode_mode})"

    entry["dayzero"] = time_engine("dayzero", arch, make_dz, args, dev, config["vocab_size"], phases)
    _free(dev)
    hf, dz, first = entry["transformers"], entry["dayzero"], args.batch[0]
    if first in hf and first in dz:
        a, b = hf[first]["tokens"], dz[first]["tokens"]
        entry["same_tokens"] = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        log(f"{arch}: same greedy tokens at batch {first}: {entry['same_tokens']} of {len(a)}")
    if args.workdir is None:
        shutil.rmtree(path, ignore_errors=True)
    return entry


def rows(results: list[dict], batches: list[int]) -> list[dict]:
    out = []
    for e in results:
        for bsz in batches:
            hf, dz = e.get("transformers", {}).get(bsz, {}), e.get("dayzero", {}).get(bsz, {})
            r = {"arch": e["arch"], "parameters": e.get("parameters"), "batch": bsz,
                 "hf_prefill_tok_s": hf.get("prefill_tok_s"), "dz_prefill_tok_s": dz.get("prefill_tok_s"),
                 "hf_decode_tok_s": hf.get("decode_tok_s"), "dz_decode_tok_s": dz.get("decode_tok_s")}
            both = r["dz_decode_tok_s"] is not None and r["hf_decode_tok_s"] is not None
            r["decode_ratio"] = r["dz_decode_tok_s"] / r["hf_decode_tok_s"] if both else None
            out.append(r)
    return out


def print_table(env: dict, table: list[dict], results: list[dict]) -> None:
    f = _fmt
    print(f"\n{env['device']}; torch {env['torch']}, transformers {env['transformers']}, triton {env['triton']}; "
          f"fla {env['fla']}")
    for e in results:
        print(f"{e['arch']}: " + ", ".join(f"{k.removesuffix('_s')} {v:.1f}s" for k, v in e["phases"].items()))
        if "error" in e:
            print(f"{e['arch']}: {e['error']}")
        for name in ("transformers", "dayzero"):
            if "error" in e.get(name, {}):
                print(f"{e['arch']}: {name} failed: {e[name]['error']}")
    print(f"{'architecture':<14} {'params':>7} {'batch':>5} {'hf decode':>10} {'dz decode':>10} {'dz/hf':>6} "
          f"{'hf prefill':>11} {'dz prefill':>11}   (tok/s)")
    for r in table:
        print(f"{r['arch']:<14} {_params(r['parameters']):>7} {r['batch']:>5} {f(r['hf_decode_tok_s'], '10.1f'):>10} "
              f"{f(r['dz_decode_tok_s'], '10.1f'):>10} {f(r['decode_ratio'], '5.2f'):>6} "
              f"{f(r['hf_prefill_tok_s'], '11.0f'):>11} {f(r['dz_prefill_tok_s'], '11.0f'):>11}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=1, help="time each run this many times, keep the fastest")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--tiny", action="store_true", help="tiny configs, for a check on the CPU")
    ap.add_argument("--workdir", default=None, help="where the checkpoints go (kept); default a temporary directory")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    env = environment(dev)
    if dev.type == "cpu":  # transformers calls these kernels whenever they import, whatever the device
        from dayzero.tools.align_hf import block_kernels

        block_kernels()
    log(f"{env['device']}, {str(dtype).removeprefix('torch.')}; torch {env['torch']}, transformers "
        f"{env['transformers']}; fla {env['fla']}")
    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="vs_transformers-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        results = [bench_arch(arch, args, dev, dtype, root) for arch in args.arch]
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    table = rows(results, args.batch)
    log("done")
    print_table(env, table, results)
    report = {"environment": env, "dtype": str(dtype), "prompt_len": args.prompt_len, "decode": args.decode,
              "repeat": args.repeat, "batches": args.batch, "tiny": args.tiny, "rows": table, "architectures": results}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2, default=str)
    return report


if __name__ == "__main__":
    main()
