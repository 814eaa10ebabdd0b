"""Engine builds with the per-shape kernel choices measured, then read from the table the first build wrote.

    python benchmarks/choice_table.py --config configs/dayzero-small.json dayzero/assets/default [--write]

For each config, two builds in processes of their own, each with an empty Triton cache (as on a fresh machine),
random weights (``load_format="dummy"``), decode graphs up to ``--max-num-seqs`` sequences and the prefill
graphs: the first with ``DAYZERO_CHOICES=measure`` (every key timed, every candidate compiled: what a build does
without a table), the second reading the table the first one wrote (only the chosen blocks compile). Prints the
seconds of both, the prefill and decode graph captures' part of them (their warm-up passes are where kernels
compile and choices are made; "other" is loading, planning and the rest), and how many keys each measured or
found. ``--write`` merges the choices into the package's table for this GPU model (``dayzero/ops/choice_tables/``,
see :mod:`dayzero.ops.choices`) as soon as the measuring build ends, so a job stopped during the second keeps
them; a build on that model then reads the table while the kernels' sources keep the digest it records.
``--measure-only`` runs the first build alone (enough for ``--write``).

A measuring build can outlast a job's time limit (~340 s on a fresh H200 for dayzero-small, most of it compiling
every candidate block). With ``--resume --cache-dir DIR`` it is done in pieces: every measured key goes into DIR's
user table as it is measured, Triton's cache is kept in DIR too, and a run with the same options reads the keys
already measured there (``DAYZERO_CHOICES=table``) and measures only the rest, so each run gets further than the
one before; ``--write`` then merges what DIR holds. Its seconds say nothing about a fresh machine.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def build(args) -> dict:
    """One engine build in this process: its seconds and the choices' counts (the child side)."""
    import torch

    from dayzero import LLM
    from dayzero.ops import choices

    t0 = time.perf_counter()
    llm = LLM(args.child, device=args.device, dtype=args.dtype, load_format="dummy", max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len)
    dev = llm.engine.device
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - t0
    runner = llm.engine.runner
    # the graph captures' seconds (their warm-up passes are where the choices are made and the kernels compile)
    phases = {kind: graphs.seconds if graphs is not None else 0.0
              for kind, graphs in (("prefill", runner.prefill_graphs), ("decode", runner.graphs))}
    if dev.type != "cuda":  # no choices are measured off the GPU
        return {"seconds": seconds, **phases, "found": 0, "measured": 0, "table": None, "device": str(dev)}
    store = choices.tables(dev)
    return {"seconds": seconds, **phases, "found": store.found, "measured": store.measured,
            "table": str(store.path), "device": store.device_name}


def child(config: str, args, mode: str, cache: str, triton_cache: str | None = None) -> dict:
    """One build in a process of its own, with an empty Triton cache unless ``triton_cache`` is given."""
    with tempfile.TemporaryDirectory() as fresh, tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = dict(os.environ, TRITON_CACHE_DIR=triton_cache or fresh, DAYZERO_CACHE_DIR=cache, DAYZERO_CHOICES=mode)
        cmd = [sys.executable, os.path.abspath(__file__), "--child", config, "--json", out.name, "--device",
               args.device, "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens",
               str(args.max_num_batched_tokens), "--max-model-len", str(args.max_model_len)]
        kept = f"Triton's cache in {triton_cache}" if triton_cache else "an empty Triton cache"
        print(f"{config}: building with DAYZERO_CHOICES={mode} and {kept} ...", flush=True)
        if subprocess.run(cmd, env=env).returncode != 0:
            raise SystemExit(f"the build of {config} with DAYZERO_CHOICES={mode} failed")
        return json.loads(Path(out.name).read_text())


def write(table: Path) -> Path:
    """Merge the user table the builds wrote into the package's table for its GPU model; the path written."""
    from dayzero.ops import choices

    new = json.loads(table.read_text())
    target = choices.PACKAGE_TABLES / choices.file_name(new["device"])
    old = choices.read(target, new["device"])  # {} unless measured on this GPU model with these kernels
    new["choices"] = dict(sorted({**old, **new["choices"]}.items()))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(new, indent=0) + "\n")
    return target


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", nargs="+", default=["configs/dayzero-small.json"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--write", action="store_true", help="merge the choices into the package's table")
    ap.add_argument("--measure-only", action="store_true",
                    help="only the build that measures every key (what --write needs), not the one reading the table")
    ap.add_argument("--cache-dir", default=None, help="the builds' DAYZERO_CACHE_DIR (default: a temporary one)")
    ap.add_argument("--resume", action="store_true",
                    help="with --cache-dir: the measuring build reads the keys measured there before and measures the "
                         "rest, with Triton's cache kept there too (a measurement done over several jobs)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.child:
        Path(args.json).write_text(json.dumps(build(args)))
        return 0
    if args.resume and not args.cache_dir:
        ap.error("--resume needs --cache-dir: the directory the measurement goes on in")
    rows = []
    with tempfile.TemporaryDirectory() as temporary:
        cache = args.cache_dir or temporary
        for config in args.config:
            if args.resume:  # the keys measured in DIR before are read, the rest measured; compiles reused
                measured = child(config, args, "table", cache, str(Path(cache).resolve() / "triton"))
            else:
                measured = child(config, args, "measure", cache)
            if args.write and measured["table"]:  # at once: a job stopped later keeps what was measured
                print(f"wrote {write(Path(measured['table']))}", flush=True)
            read = None if args.measure_only else child(config, args, "table", cache)
            rows.append((config, measured, read))
        caches = ("a measurement resumed with Triton's cache kept: not a fresh machine's seconds" if args.resume
                  else "each with an empty Triton cache")
        print(f"\n{rows[0][1]['device']}: engine builds, {caches} (seconds: the build, of it the prefill and decode"
              " graph captures)")
        print(f"{'config':<30} {'choices':<8} {'build s':>8} {'prefill':>8} {'decode':>8} {'other':>8} {'measured':>8} "
              f"{'found':>6}")
        for config, m, r in rows:
            for name, b in (("measure", m), ("table", r)) if r else (("measure", m),):
                other = b["seconds"] - b["prefill"] - b["decode"]
                print(f"{config:<30} {name:<8} {b['seconds']:>8.1f} {b['prefill']:>8.1f} {b['decode']:>8.1f} "
                      f"{other:>8.1f} {b['measured']:>8} {b['found']:>6}")
            if r:
                print(f"{config:<30} {'ratio':<8} {m['seconds'] / r['seconds']:>7.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps([{"config": c, "measure": m, "table": r} for c, m, r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
