"""Write a trained checkpoint's model card (``README.md``) from an evaluation on this machine: held-out accuracy
per task (``dayzero eval``'s instances) and the signal subset (``dayzero/eval/signal.py``) that CI scores again,
both in fp32 on the CPU, the setting of the issue's targets and of the CI test.

    python scripts/card_default.py dayzero/assets/default --training training.md [--n 100] [--context-len 2048]

``--training`` holds the card's Training section (a model trained over several jobs: each job's command, steps
and time); the training script writes its own card for a single job.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    from dayzero.eval.tasks import RECALL_STYLES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="checkpoint directory (config.json, model.safetensors, tokenizer)")
    ap.add_argument("--training", required=True, metavar="FILE", help="the Training section, markdown")
    ap.add_argument("--n", type=int, default=100, help="held-out instances per task")
    ap.add_argument("--context-len", type=int, default=2048, help="recall prompts' tokens")
    ap.add_argument("--recall-style", default="letter", choices=RECALL_STYLES,
                    help="how the model was taught recall pairs (dayzero eval's --recall-style); the card records it")
    args = ap.parse_args(argv)

    from dayzero.config.model_config import HybridConfig
    from dayzero.eval.modes import engine_session
    from dayzero.eval.signal import signal_instances
    from dayzero.eval.tasks import TASKS
    from dayzero.tools import eval_cli
    from dayzero.tools.model_info import count_params, load
    from dayzero.train.card import write_model_card
    from dayzero.train.evaluate import evaluate

    model = Path(args.model)
    config = HybridConfig.from_file(model / "config.json")
    rows = evaluate(model, n=args.n, context_len=args.context_len, device="cpu", dtype="float32",
                    recall_style=args.recall_style)
    print(eval_cli.table(rows), flush=True)
    with engine_session(model=str(model), device="cpu", dtype="float32") as llm:
        count = lambda text: len(llm.tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
        insts = signal_instances(count, args.recall_style)
        signal = eval_cli.score(insts, eval_cli.answers(llm, insts))
    print(eval_cli.table(signal), flush=True)
    packed = (config.extra.get("quantization_config") or {}).get("quant_method") == "mxfp4"
    setup = {"device": "cpu", "dtype": "float32", "n": args.n, "context_len": args.context_len, "max_digits": 5,
             "recall_style": args.recall_style}
    path = write_model_card(model, config=config, n_params=count_params(load(model))["params_total"],
                            size_bytes=(model / "model.safetensors").stat().st_size,
                            expert_format="mxfp4" if packed else "bf16", tasks=list(TASKS), rows=rows,
                            eval_setup=setup, signal_rows=signal,
                            training=Path(args.training).read_text().strip())
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
