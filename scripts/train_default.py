"""Train the bundled default model (a small ``dayzero_hybrid``: KDA, gated DSA, LatentMoE) on the synthetic tasks
of ``dayzero eval`` (their train split), write it as a checkpoint and score it on held-out instances.

    python scripts/train_default.py --device cuda --recipe bundled --out trained   # the bundled model's job
    python scripts/train_default.py --device cuda --minutes 8 --out trained
    python scripts/train_default.py --tiny --steps 20 --out /tmp/tiny     # CPU smoke run

``--recipe bundled`` sets the options of the bundled model's own job (15 minutes from scratch;
:mod:`dayzero.train.recipes`); a flag given beside it still wins.

``--minutes`` is the whole job's budget: training stops by the clock early enough to save the checkpoint and
run the final evaluation (``--eval-seconds`` are kept for those). The checkpoint in ``--out`` has the files of
``dayzero/assets/default`` (routed experts in MXFP4 unless ``--expert-format bf16``) and loads with
``dayzero.LLM(out)``; the final table is ``dayzero eval``'s (``--eval-n`` instances per task through the engine),
and ``README.md`` beside it is the model card (:mod:`dayzero.train.card`: size, tasks, command, time, accuracy).

A job longer than one process may run (a GPU lent for ten minutes at a time) pauses and resumes
(:mod:`dayzero.train.resume`): ``--pause-after 7`` stops training after 7 minutes and writes the checkpoint with
the trainer's state, and ``--resume DIR --out DIR2`` carries the same job on, with its options, schedule and
optimizer, to the end of its ``--minutes``:

    python scripts/train_default.py --device cuda --minutes 15 --pause-after 7 --out part1
    python scripts/train_default.py --device cuda --resume part1 --out trained
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = ROOT / "configs"
DEFAULT_CONFIG = CONFIGS / "dayzero-default-train.json"
TINY_CONFIG = CONFIGS / "dayzero-train-tiny.json"


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; ``--recipe NAME`` first sets its options' defaults, so a flag given still wins."""
    from dayzero.train.recipes import RECIPES

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--recipe", default=None)
    recipe = pre.parse_known_args(argv)[0].recipe
    ap = _parser()
    if recipe in RECIPES:  # an unknown one: the whole parser names the known ones
        ap.set_defaults(**RECIPES[recipe])
    return ap.parse_args(argv)


def _parser() -> argparse.ArgumentParser:
    from dayzero.eval.tasks import RECALL_STYLES
    from dayzero.train.recipes import RECIPES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=None, choices=sorted(RECIPES),
                    help="a documented job's options as defaults (bundled: the bundled model's 15-minute job from "
                         "scratch, dayzero/train/recipes.py); flags given still win")
    ap.add_argument("--device", default="auto", help="auto (CUDA when present) | cpu | cuda | cuda:N")
    ap.add_argument("--minutes", type=float, default=None,
                    help="time budget of the whole job (default 8; none with --steps)")
    ap.add_argument("--steps", type=int, default=None, help="stop after this many steps (or the clock, first)")
    ap.add_argument("--out", required=True, help="checkpoint directory to write")
    ap.add_argument("--overwrite", action="store_true", help="write into --out even when it holds files")
    ap.add_argument("--tiny", action="store_true", help="a tiny model and small steps (CPU smoke runs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init", default=None, metavar="DIR",
                    help="start from this checkpoint's weights (MXFP4 experts dequantised) and config, with a fresh "
                         "optimizer and schedule: a run continued over several time-limited jobs")
    ap.add_argument("--config", default=None, help=f"model config (default {DEFAULT_CONFIG.relative_to(ROOT)})")
    ap.add_argument("--tasks", default=None, help="comma-separated training tasks (default: all of dayzero eval's)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per step (default 98304; --tiny 2048)")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default 2e-3)")
    ap.add_argument("--copy-warmup", type=float, default=None, metavar="F",
                    help="fraction of training in which copies take most of the non-recall tokens (default 0.5)")
    ap.add_argument("--recall-min-pairs", type=int, default=None, metavar="N",
                    help="fewest key-value pairs in a training recall prompt (default 2; the eval split has 8)")
    ap.add_argument("--recall-style", default="letter", choices=RECALL_STYLES,
                    help="recall pairs as `K=1234.` asked with `K=` (letter, the default), `K1234.` asked with `K` "
                         "(joined), `abcd=1234.` asked with `abcd=` (assign), or as sentences (the earlier runs' "
                         "formats)")
    ap.add_argument("--recall-questions", type=int, default=None, metavar="N",
                    help="questions per plain-format training recall prompt, each answered (default 4; eval asks 1)")
    ap.add_argument("--recall-lengths", default=None, metavar="MIN,START,MAX",
                    help="recall prompts' token counts: uniform from MIN to a bound growing from START to MAX over "
                         "the first half of training (default 128,384,2560; --tiny 64,96,160)")
    ap.add_argument("--sparse-from", type=float, default=None, metavar="F",
                    help="fraction of training after which the DSA layers attend over their indexers' top-k; before "
                         "it, dense attention while the indexers learn to match it (default 0.7; 0 continues an "
                         "--init run whose indexers are trained)")
    ap.add_argument("--recall-share", type=float, default=None, metavar="F",
                    help="share of a step's tokens in recall prompts (default 0.4)")
    ap.add_argument("--chat-share", type=float, default=None, metavar="F",
                    help="share of instances in the chat format (default 0.2)")
    ap.add_argument("--question-share", type=float, default=None, metavar="F",
                    help="share of chat-format addition and subtraction asked in words, `What is 48213 + 3771?` "
                         "(default 0.5)")
    ap.add_argument("--loss-parts", default=None, metavar="TASK=W,..",
                    help="tasks' parts of the loss relative to the others' (default 1 each), e.g. recall=3,copy=2")
    ap.add_argument("--loss-balance", default="task", choices=["task", "token"],
                    help="the LM loss per task, each task of a step an equal part (default), or per answer token")
    ap.add_argument("--expert-format", default="mxfp4", choices=["mxfp4", "bf16"], help="routed experts on disk")
    ap.add_argument("--workers", type=int, default=None, help="data worker processes (default 6 on CUDA, 0 on CPU)")
    ap.add_argument("--eval-n", type=int, default=100, help="held-out instances per task in the final table (0: none)")
    ap.add_argument("--eval-every", type=float, default=150.0, metavar="S",
                    help="seconds between quick held-out evaluations during training (0: none)")
    ap.add_argument("--eval-seconds", type=float, default=None, metavar="S",
                    help="seconds of the budget kept for saving and the final evaluation (default 75 on CUDA)")
    ap.add_argument("--log-every", type=int, default=None, help="steps between progress lines")
    ap.add_argument("--profile", default=None, metavar="FILE",
                    help="write the profiler's tables of one step (GPU and host time, by op and by caller) to FILE")
    ap.add_argument("--profile-step", type=int, default=3, metavar="N", help="the step --profile records (default 3)")
    ap.add_argument("--pause-after", type=float, default=None, metavar="MIN",
                    help="stop this process after MIN minutes of training, writing the checkpoint and the trainer's "
                         "state to --out, for --resume to carry the job on (a GPU lent for less than the job)")
    ap.add_argument("--pause-at-step", type=int, default=None, metavar="N", help="pause once N steps are done")
    ap.add_argument("--resume", default=None, metavar="DIR",
                    help="carry on the job that paused in DIR, with its own options (only --out, --device and the "
                         "options of this process, the evaluation's and the pauses', may be given)")
    return ap


# what a resumed job takes from this process's command line; every other option is the job's own
PER_PROCESS = {"out", "device", "overwrite", "pause_after", "pause_at_step", "resume", "eval_n", "eval_every",
               "eval_seconds", "workers", "log_every", "profile", "profile_step"}
_PER_PROCESS_FLAGS = {"--" + n.replace("_", "-") for n in PER_PROCESS}


def job_argv(argv: list[str]) -> list[str]:
    """The job's own options among ``argv`` (those a resumed process keeps), without this process's."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        flag = a.split("=", 1)[0]
        if flag in _PER_PROCESS_FLAGS:
            skip = "=" not in a and flag != "--overwrite"
            continue
        out.append(a)
    return out


def resumed_args(args: argparse.Namespace, saved_argv: list[str]) -> argparse.Namespace:
    """The paused job's options with this process's own; ValueError if this command line sets a job option."""
    defaults = parse_args(["--out", "-"])
    given = sorted(n for n, v in vars(args).items() if n not in PER_PROCESS and v != getattr(defaults, n))
    if given:
        raise ValueError(f"--resume takes the job's own options from its state: leave out "
                         f"{', '.join('--' + n.replace('_', '-') for n in given)}")
    job = parse_args(saved_argv + ["--out", args.out])
    for name in PER_PROCESS:
        setattr(job, name, getattr(args, name))
    return job


def check(args) -> None:
    """Every option checked before anything is built; ValueError naming the one at fault."""
    from dayzero.train.recipes import parse_loss_parts, parse_recall_lengths, parse_tasks

    if args.minutes is None and args.steps is None:
        args.minutes = 8.0
    if args.minutes is not None and not args.minutes > 0:
        raise ValueError(f"--minutes must be positive, got {args.minutes}")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    if args.recall_share is not None and not 0 < args.recall_share < 1:
        raise ValueError(f"--recall-share must be in (0, 1), got {args.recall_share}")
    if isinstance(args.loss_parts, str):
        args.loss_parts = parse_loss_parts(args.loss_parts)
    if args.sparse_from is not None and not 0 <= args.sparse_from <= 1:
        raise ValueError(f"--sparse-from must be in [0, 1], got {args.sparse_from}")
    for flag, v in (("--chat-share", args.chat_share), ("--question-share", args.question_share)):
        if v is not None and not 0 <= v <= 1:
            raise ValueError(f"{flag} must be in [0, 1], got {v}")
    if args.copy_warmup is not None and not 0 <= args.copy_warmup <= 1:
        raise ValueError(f"--copy-warmup must be in [0, 1], got {args.copy_warmup}")
    parse_tasks(args.tasks)
    if args.recall_lengths is not None:
        parse_recall_lengths(args.recall_lengths)
    if args.init is not None:
        if args.config is not None:
            raise ValueError("--init takes the checkpoint's own config: leave out --config")
        if not (Path(args.init) / "config.json").is_file() or not (Path(args.init) / "model.safetensors").is_file():
            raise ValueError(f"--init {args.init}: no config.json and model.safetensors there")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        raise ValueError(f"--out {out} exists and is not empty; pass --overwrite to write into it")
    for name in ("tokens", "workers", "log_every", "profile_step", "pause_at_step"):
        v = getattr(args, name)
        if v is not None and v < (0 if name == "workers" else 1):
            need = ">= 0" if name == "workers" else "positive"
            raise ValueError(f"--{name.replace('_', '-')} must be {need}, got {v}")
    if args.lr is not None and not args.lr > 0:
        raise ValueError(f"--lr must be positive, got {args.lr}")
    if args.pause_after is not None and not args.pause_after > 0:
        raise ValueError(f"--pause-after must be positive, got {args.pause_after}")
    if args.eval_n < 0 or args.eval_every < 0:
        raise ValueError("--eval-n and --eval-every must be >= 0")


def _portable(argv: list[str]) -> list[str]:
    """The arguments with the paths they name cut to their last part (the card names no machine's folders)."""
    out, path_next = [], False
    for a in argv:
        if path_next:
            a, path_next = Path(a).name or a, False
        elif a in ("--out", "--profile", "--config", "--init"):
            path_next = True
        elif a.startswith(("--out=", "--profile=", "--config=", "--init=")):
            flag, value = a.split("=", 1)
            a = f"{flag}={Path(value).name}"
        out.append(a)
    return out


def _device_name(device) -> str:
    import torch

    return f"one {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "a CPU"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    state, job = None, job_argv(argv)
    if args.resume:
        from dayzero.train.resume import load_state

        state = load_state(args.resume)
        args, job = resumed_args(args, state["argv"]), state["argv"]
    check(args)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the data workers fork after the tokenizer loads
    # every step has other shapes: growable segments keep the allocator from freeing and re-allocating
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch

    from dayzero.config.model_config import HybridConfig
    from dayzero.engine.device import configure_threads, resolve_device
    from dayzero.engine.engine import DEFAULT_MODEL
    from dayzero.engine.tokenizer import load_tokenizer
    from dayzero.train.card import write_model_card
    from dayzero.train.checkpoint import load_model, new_model, save_checkpoint
    from dayzero.tools.eval_cli import table
    from dayzero.train.evaluate import evaluate
    from dayzero.train.loop import TrainConfig, Trainer
    from dayzero.train.recipes import DATA_OPTIONS, data_config, parse_tasks

    t0 = time.monotonic()
    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    if not cuda:
        configure_threads()  # fewer threads than cores on a loaded machine: torch's would wait on each other
    default_config = TINY_CONFIG if args.tiny else DEFAULT_CONFIG
    start_from = args.resume or args.init  # a checkpoint's weights and config
    config = HybridConfig.from_file(Path(start_from) / "config.json" if start_from else args.config or default_config)
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    tasks = parse_tasks(args.tasks)
    data = data_config(**{name: getattr(args, name) for name in DATA_OPTIONS}, tiny=args.tiny)
    reserve = args.eval_seconds if args.eval_seconds is not None else (75.0 if cuda else 30.0)
    seconds = None
    if state is not None:  # the job's budget, as its first process set it
        seconds = state["budget"]
    elif args.minutes is not None:
        seconds = args.minutes * 60 - reserve - (time.monotonic() - t0)
        if seconds <= 0:
            raise ValueError(f"--minutes {args.minutes} leaves no time to train after the {reserve:.0f} s kept for "
                             "saving and evaluating (--eval-seconds)")
    out = Path(args.out)
    train_config = TrainConfig(
        seconds=seconds, steps=args.steps, lr=args.lr or 2e-3, seed=args.seed, data=data,
        workers=args.workers if args.workers is not None else (6 if cuda else 0),
        log_every=args.log_every or (20 if cuda else 1), warmup_steps=5 if args.tiny else 30,
        eval_every=(args.eval_every or None) if cuda else None,
        fake_mxfp4=args.expert_format == "mxfp4", profile_file=args.profile, profile_step=args.profile_step,
        pause_seconds=None if args.pause_after is None else args.pause_after * 60, pause_step=args.pause_at_step,
        sparse_from=TrainConfig.sparse_from if args.sparse_from is None else args.sparse_from)
    torch.manual_seed(args.seed)
    model = load_model(start_from, device) if start_from else new_model(config, device, args.seed)
    if state is not None:
        model.load_state_dict(state["model"])  # the fp32 masters (the checkpoint's experts are MXFP4-rounded)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: dayzero_hybrid {config.hidden_size}x{config.num_hidden_layers} ({', '.join(config.layer_types)}), "
          f"{n_params / 1e6:.1f}M parameters, on {device}; {data.tokens} tokens a step; tasks {', '.join(tasks)}",
          flush=True)

    def quick_eval(step: int) -> None:
        save_checkpoint(model, config, out, DEFAULT_MODEL, args.expert_format)
        rows = evaluate(out, n=16, tasks=tasks, device=str(device), enforce_eager=True, recall_style=data.recall_style,
                        cache_memory_bytes=2 << 30, max_model_len=4096)
        print(f"eval at step {step}: " + "  ".join(f"{r['task']} {r['accuracy']:.0%} ({r['chars']:.0%} chars)"
                                                    for r in rows), flush=True)

    trainer = Trainer(model, tokenizer, train_config, device, log=lambda s: print(s, flush=True), on_eval=quick_eval)
    if state is not None:
        trainer.load_state_dict(state["trainer"])
        print(f"resumed at step {trainer.step} after {trainer.before:.0f} s of training", flush=True)
    summary = trainer.train()
    save_checkpoint(model, config, out, DEFAULT_MODEL, args.expert_format)
    if summary["paused"]:
        from dayzero.train.resume import save_state

        save_state(out, trainer, model, job, seconds)
        print(f"paused at step {summary['steps']} after {summary['seconds']:.0f} s of training; carry on with: "
              f"python scripts/train_default.py --resume {out} --out DIR", flush=True)
        return 0
    size = (out / "model.safetensors").stat().st_size
    print(f"trained {summary['steps']} steps, {summary['tokens'] / 1e6:.1f}M tokens in {summary['seconds']:.0f} s; "
          f"wrote {out} (model.safetensors {size / 2**20:.1f} MiB, experts {args.expert_format})", flush=True)
    rows, setup = [], {}
    if args.eval_n:
        ctx = 2048 if not args.tiny else 128
        rows = evaluate(out, n=args.eval_n, tasks=tasks, context_len=ctx, max_digits=data.max_digits,
                        device=str(device), cache_memory_bytes=4 << 30 if cuda else 1 << 28,
                        recall_style=data.recall_style)
        setup = {"device": device.type, "dtype": "bfloat16" if cuda else "float32", "n": args.eval_n,
                 "context_len": ctx, "max_digits": data.max_digits, "recall_style": data.recall_style}
        print(f"{out}: exact match, greedy, held-out (eval split), recall at {ctx} tokens")
        print(table(rows))
    command = " ".join(["python scripts/train_default.py", *_portable(argv if state is None else job)])
    if state is not None:
        command += " (paused with --pause-after, carried on with --resume)"
    write_model_card(out, config=config, n_params=n_params, size_bytes=size, expert_format=args.expert_format,
                     tasks=tasks, command=command, device=_device_name(device), summary=summary, rows=rows,
                     eval_setup=setup)
    print(f"total {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
