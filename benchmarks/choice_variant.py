"""A variant of a GPU model's choice table, written as a user table, to time in the engine against the table itself.

    python benchmarks/choice_variant.py /tmp/shipped
    python benchmarks/choice_variant.py /tmp/fused --fuse-norms 4
    DAYZERO_CACHE_DIR=/tmp/fused python benchmarks/engine_throughput.py --config configs/dayzero-small.json \\
        --device cuda --batch 4 --baseline-env DAYZERO_CACHE_DIR=/tmp/shipped

The per-shape choices (``dayzero.ops.choices``) are each measured alone: a key's fused launch against its ops apart,
replayed over L2-cold weights. Inside a decode step an op apart is one more dependent launch in a chain of them,
which a key timed alone may not weigh as the step does. This writes the package's table for a GPU model
(``--source``, by default this GPU's; the H100's on an H200 gives both sides the same choices; measured with these
kernels, under any Triton version) into DIR's user table under this GPU's name and the kernels' digest with the
installed Triton, with every ``rms_norm_linear`` and ``rms_norm_gated_linear`` key of ``--fuse-norms`` rows that
runs apart given a fused block (the plain linear's Triton block at that shape where it is one of the fused launch's
candidates, else the first tensor-core candidate, else the first), and any ``--set PREFIX=BLOCK`` applied to the
keys starting with PREFIX (``none``: the ops apart or cuBLAS). The engine run with ``DAYZERO_CACHE_DIR=DIR`` reads
it before the package's table; two DIRs, one with no change, are the two sides of a side-by-side run.
``--device-name`` names the GPU without one (tests).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

NORM_OPS = ("rms_norm_linear", "rms_norm_gated_linear")


def fused_block(key: str, choices: dict) -> list[int] | None:
    """The block a norm op's key takes when fused: see the module docstring."""
    from dayzero.ops.linear import kernels as K
    from dayzero.ops.linear.norm import gated_candidates

    op, fields = key.split(":", 1)
    f = fields.split(",")
    rows, n, k = int(f[0]), int(f[1]), int(f[2])
    mma = K.tensor_cores(getattr(torch, f[3]), getattr(torch, f[4]))
    cands = (gated_candidates(rows, n, k, int(f[8]), mma) if op == "rms_norm_gated_linear"
             else K.candidates(rows, n, k, mma))
    plain = choices.get("linear:" + ",".join(f[:8]))
    if plain is not None and tuple(plain) in cands:
        return list(plain)
    return list(next((c for c in cands if len(c) == 4), cands[0]))


def variant(choices: dict, fuse_rows: list[int], sets: list[tuple[str, list[int] | None]]) -> dict[str, tuple]:
    """Apply the variants to ``choices`` in place; returns key -> (before, after) for each key changed."""
    changed = {}
    for key, value in list(choices.items()):
        op, fields = key.split(":", 1)
        if op in NORM_OPS and value is None and int(fields.split(",")[0]) in fuse_rows:
            choices[key] = fused_block(key, choices)
            changed[key] = (value, choices[key])
    for prefix, block in sets:
        hits = [key for key in choices if key.startswith(prefix)]
        if not hits:
            raise SystemExit(f"--set {prefix}: no key of the table starts so")
        for key in hits:
            changed[key] = (choices[key], block)
            choices[key] = block
    return changed


def parse_set(text: str) -> tuple[str, list[int] | None]:
    prefix, _, block = text.rpartition("=")
    if not prefix:
        raise argparse.ArgumentTypeError(f"{text!r}: expected PREFIX=BLOCK, e.g. rms_norm_linear:4,=16,256,4,4")
    if block.lower() == "none":
        return prefix, None
    try:
        value = [int(v) for v in block.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: BLOCK is 3 or 4 comma-separated ints, or none") from None
    from dayzero.ops.choices import valid

    if not valid(value):
        raise argparse.ArgumentTypeError(f"{text!r}: BLOCK is 3 or 4 positive ints, or none")
    return prefix, value


def main(argv: list[str] | None = None) -> dict:
    from dayzero.ops import choices as C

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="the DAYZERO_CACHE_DIR the variant is written into")
    ap.add_argument("--source", default=None, help="the package table's GPU model (default: this GPU's)")
    ap.add_argument("--fuse-norms", type=int, nargs="*", default=[], metavar="ROWS",
                    help="row buckets whose norms apart are fused")
    ap.add_argument("--set", type=parse_set, action="append", default=[], metavar="PREFIX=BLOCK")
    ap.add_argument("--device-name", default=None, help="the GPU's name (default: CUDA device 0's)")
    args = ap.parse_args(argv)
    name = args.device_name or torch.cuda.get_device_name(0)
    source = C.PACKAGE_TABLES / (f"{args.source}.json" if args.source else C.file_name(name))
    if not source.exists():
        tables = sorted(p.stem for p in C.PACKAGE_TABLES.glob("*.json"))
        raise SystemExit(f"no package table {source.name}; the package has {', '.join(tables) or 'none'}")
    table = json.loads(source.read_text())
    if table.get("digest") != C.digest_with(table.get("triton")):  # written under this Triton's digest below
        raise SystemExit(f"{source.name} was measured with other kernels (digest {table.get('digest')}, these "
                         f"{C.digest_with(table.get('triton'))}): measure it again first (benchmarks/choice_table.py)")
    choices = dict(table["choices"])
    changed = variant(choices, args.fuse_norms, args.set)
    out = Path(args.dir) / "choices" / C.file_name(name, f"-{C.digest()}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": name, "digest": C.digest(), "torch": torch.__version__,
                               "triton": C.triton_version(), "choices": dict(sorted(choices.items()))}, indent=0))
    print(f"{source.name}: {len(choices)} choices, {len(changed)} changed, as {name}'s user table {out}")
    for key, (before, after) in changed.items():
        print(f"  {key[:100]:<100} {before} -> {after}")
    return {"path": str(out), "changed": changed}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
