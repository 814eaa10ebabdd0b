"""``dayzero eval [MODEL] [--tasks ...] [--n N] [--context-len L] [--url URL] [--json]``: exact-match accuracy of
the model on seeded held-out instances of the synthetic tasks (:mod:`dayzero.eval.tasks`), each task with its
95% interval (Wilson's score interval).

Without ``--url`` the instances run through ``LLM.generate`` in this process (continuous batching over all of
them); with it they go to a running server's ``/v1/completions``, ``--concurrency`` at a time. Greedy decoding,
stopping at the newline that ends an answer; the answer counts when the completion, stripped, equals it. The
table goes to stdout (or one JSON object with ``--json``, with every instance's answer and output), the progress
bar and the model line to stderr.

With ``--modes`` the same instances run through one engine per mode (:mod:`dayzero.eval.modes`: fp32, bf16, the
MXFP4 experts' workspaces, FP8 / INT8 caches, chunked prefill, forced preemption, batch 1 or 64, the prefix cache
on a second pass, eager steps), and the table gives each task's accuracy per mode and the share of answers equal
to the first mode's.
"""
from __future__ import annotations

import json
import math
import sys
from concurrent.futures import ThreadPoolExecutor

from dayzero.eval.modes import MODES, mode_names, run_mode
from dayzero.eval.tasks import RECALL_STYLES, TASKS, Instance, as_question, instances
from dayzero.tools.cli_options import Help, add_engine_options, engine_kwargs
from dayzero.tools.progress import bar, note

# --format: how the instances are asked (its words in the table's title); "question" is chat with arithmetic in words
FORMATS = {"plain": "", "chat": ", asked as chat messages", "question": ", asked as questions in words"}
DESCRIPTION = (
    "Exact-match accuracy per task on seeded held-out instances (the eval seed stream, never the training one): "
    "multi-digit addition and subtraction, string reversal and sorting, key-value recall from far back in filler "
    "text (--context-len tokens), copying a passage. Greedy decoding through the engine in this process, or "
    "against a running server with --url. Prints each task's accuracy with a 95% interval.")


def add_parser(sub) -> None:
    e = sub.add_parser("eval", help="exact-match accuracy on seeded synthetic tasks (arithmetic, reversal, sorting, "
                                    "long-context recall, copying)", description=DESCRIPTION, formatter_class=Help)
    e.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: the bundled model); with "
                                                          "--url only its tokenizer is used, to size recall prompts")
    e.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, from: {', '.join(TASKS)}")
    e.add_argument("--n", type=int, default=100, help="instances per task")
    e.add_argument("--context-len", type=int, default=2048, metavar="L", help="tokens of a recall prompt")
    e.add_argument("--max-digits", type=int, default=5, help="operand digits of addition and subtraction")
    e.add_argument("--recall-style", default=None, choices=RECALL_STYLES,
                   help="recall pairs written `K=1234.` and asked with `K=`, one capital letter a key (letter), "
                        "`K1234.` asked with `K` (joined: the value right after its key), `abcd=1234.` asked with "
                        "`abcd=` (assign), or as sentences, `The value of abcd is 1234.` (the formats of earlier "
                        "training runs); default: the style the model's card records it was trained on, else letter")
    e.add_argument("--format", default="plain", choices=list(FORMATS),
                   help="how instances are asked: as plain completions (the training format, `48213+3771=`), as chat "
                        "messages through the model's chat template, or as chat messages with arithmetic asked in "
                        "words (`What is 48213 + 3771?`)")
    e.add_argument("--task-seed", type=int, default=0, help="which held-out instances (the eval stream's seed)")
    e.add_argument("--url", default=None, help="a running server, e.g. http://127.0.0.1:8000 (default: the engine "
                                               "in this process)")
    e.add_argument("--api-key", default=None, metavar="KEY", help="bearer key for --url (default: $DAYZERO_API_KEY)")
    e.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="model name in requests to --url (default: the first the server lists)")
    e.add_argument("--concurrency", type=int, default=16, help="requests in flight with --url")
    e.add_argument("--timeout", type=float, default=600.0, metavar="S", help="seconds per HTTP request")
    e.add_argument("--json", action="store_true", help="one JSON object on stdout")
    e.add_argument("--modes", default=None, metavar="M,M,...",
                   help="run the instances once per engine mode and compare (the first is the reference): "
                        + ", ".join(MODES))
    add_engine_options(e)
    e.set_defaults(func=run, runs_model=True, needs_weights=True)


def wilson(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% score interval of a binomial proportion (sound at 0% and 100%, unlike the normal approximation)."""
    if n == 0:
        return 0.0, 1.0
    p = correct / n
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    d = 1 + z * z / n
    return max(0.0, (centre - half) / d), min(1.0, (centre + half) / d)


def _task_names(spec: str) -> list[str]:
    names = [t.strip() for t in spec.split(",") if t.strip()]
    bad = [t for t in names if t not in TASKS]
    if bad or not names:
        raise ValueError(f"--tasks: unknown task {', '.join(bad) or '(none given)'}; the tasks are {', '.join(TASKS)}")
    return names


def check_options(args) -> None:
    """Every option checked before anything loads; raises ``ValueError`` naming the one at fault."""
    _task_names(args.tasks)
    if args.n < 1:
        raise ValueError(f"--n must be at least 1, got {args.n}")
    if args.context_len < 64:
        raise ValueError(f"--context-len must be at least 64 tokens, got {args.context_len}")
    if args.max_digits < 1:
        raise ValueError(f"--max-digits must be at least 1, got {args.max_digits}")
    if args.url is not None and not args.url.startswith(("http://", "https://")):
        raise ValueError(f"--url must be an http:// or https:// address, got {args.url!r}")
    if getattr(args, "modes", None) is not None:
        mode_names(args.modes)
        if args.url is not None:
            raise ValueError("--modes builds an engine per mode in this process; it cannot run against --url")


def recall_style(args) -> str:
    """``--recall-style``, else the style the model learnt, as its card records (letter without a card)."""
    if args.recall_style is not None:
        return args.recall_style
    from dayzero.engine.engine import DEFAULT_MODEL
    from dayzero.train.card import trained_recall_style

    return trained_recall_style(args.model or DEFAULT_MODEL)


def build(args, tokenizer) -> list[Instance]:
    count = (lambda text: len(tokenizer.encode(text, add_special_tokens=False))) if tokenizer is not None else None
    out = []
    for task in _task_names(args.tasks):
        out += instances(task, args.n, "eval", args.task_seed, max_digits=args.max_digits, context_len=args.context_len,
                         count=count, style=recall_style(args))
    return [as_question(i) for i in out] if args.format == "question" else out


def chat_format(args) -> bool:
    return args.format != "plain"


def max_answer_tokens(inst: Instance) -> int:
    return len(inst.answer) + 8  # a token is at least one character; room for the newline that stops it


def answers(llm, insts: list[Instance], progress: bool = False, chat: bool = False) -> list[str]:
    """The engine's completions of ``insts``, as ``dayzero eval`` asks for them: greedy, up to the newline that
    ends an answer, all in one ``generate`` (continuous batching); with ``chat``, each prompt is a user message
    through the model's chat template, and the reply ends at its end of turn."""
    from dayzero import SamplingParams

    params = [SamplingParams(max_tokens=max_answer_tokens(i), temperature=0.0, stop=["\n"]) for i in insts]
    if chat:
        outs = llm.chat([[{"role": "user", "content": i.prompt}] for i in insts], params, use_tqdm=progress)
    else:
        outs = llm.generate([i.prompt for i in insts], params, use_tqdm=progress)
    return [o.outputs[0].text for o in outs]


def _in_process(args) -> tuple[list[Instance], list[str], str]:
    from dayzero import LLM

    llm = LLM(**engine_kwargs(args))
    eng = llm.engine
    if llm.tokenizer is None:
        raise ValueError(f"{eng.path} has no tokenizer: the tasks are text")
    note(f"model {eng.path} on {eng.device} in {str(eng.dtype).removeprefix('torch.')}")
    insts = build(args, llm.tokenizer)  # recall prompts sized by the engine's own tokenizer
    check_fits(insts, llm.tokenizer, eng.max_model_len, args.context_len)
    return insts, answers(llm, insts, sys.stderr.isatty(), chat_format(args)), str(eng.path)


def check_fits(insts: list[Instance], tokenizer, max_model_len: int, context_len: int) -> None:
    """Refuse, before any is run, recall prompts that reach the engine's context length, naming the option that
    makes room (a recall prompt is ``--context-len`` tokens of pairs and filler plus its question)."""
    recall = [i for i in insts if i.task == "recall"]
    longest = max((len(tokenizer.encode(i.prompt, add_special_tokens=False)) for i in recall), default=0)  # as LLM does
    if longest + max((max_answer_tokens(i) for i in recall), default=0) > max_model_len:
        room = -(-(longest + 64) // 256) * 256
        raise ValueError(f"recall prompts of --context-len {context_len} reach {longest} tokens with their questions, "
                         f"past the engine's context length of {max_model_len}: pass --max-model-len {room} (the "
                         f"model's positions are a default, not its RoPE's limit) or a shorter --context-len")


def _over_http(args) -> tuple[list[Instance], list[str], str]:
    from pathlib import Path

    from dayzero.engine.engine import DEFAULT_MODEL
    from dayzero.engine.tokenizer import load_tokenizer
    from dayzero.tools.bench_http import _httpx, served_model, target

    httpx = _httpx()
    url, headers = target(args.url, args.api_key)
    model = args.served_model_name or served_model(url, headers, args.timeout)
    path = Path(args.model) if args.model else DEFAULT_MODEL
    insts = build(args, load_tokenizer(path if path.is_dir() else path.parent))  # None: recall counts words
    progress = bar(len(insts), "eval", unit="req")

    chat = chat_format(args)
    route = "/v1/chat/completions" if chat else "/v1/completions"

    def one(inst: Instance) -> str:
        body = {"model": model, "max_tokens": max_answer_tokens(inst), "temperature": 0.0, "stop": ["\n"]}
        body.update({"messages": [{"role": "user", "content": inst.prompt}]} if chat else {"prompt": inst.prompt})
        try:
            r = httpx.post(url + route, json=body, headers=headers, timeout=args.timeout)
        except httpx.HTTPError as e:
            raise ValueError(f"--url {url}: a completion request failed: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise ValueError(f"--url {url}: a completion request failed with HTTP {r.status_code}: {r.text[:200]}")
        progress.update()
        choice = r.json()["choices"][0]
        return (choice["message"]["content"] or "") if chat else choice["text"]

    with ThreadPoolExecutor(max(1, args.concurrency)) as pool:
        texts = list(pool.map(one, insts))
    progress.close()
    return insts, texts, f"{url} ({model})"


def correct(inst: Instance, text: str) -> bool:
    """Exact match: the completion, stripped of the whitespace around it, is the answer."""
    return text.strip() == inst.answer


def chars_in_place(inst: Instance, text: str) -> float:
    """Partial credit: characters the stripped completion has at the answer's places, over the longer of the two
    (a four-digit recall answer with two digits right scores 0.5, and one with a fifth digit 0.8; exact match 1)."""
    got = text.strip()
    return sum(a == b for a, b in zip(inst.answer, got)) / max(1, len(inst.answer), len(got))


def score(insts: list[Instance], texts: list[str]) -> list[dict]:
    """Per task: n, correct, accuracy (exact match) with its 95% interval (low, high), and ``chars``, the mean
    share of answer characters in place (:func:`chars_in_place`), a graded signal while exact answers are rare."""
    rows = []
    for task in dict.fromkeys(i.task for i in insts):
        pairs = [(i, t) for i, t in zip(insts, texts) if i.task == task]
        got = [correct(i, t) for i, t in pairs]
        lo, hi = wilson(sum(got), len(got))
        rows.append({"task": task, "n": len(got), "correct": sum(got), "accuracy": sum(got) / len(got),
                     "low": lo, "high": hi, "chars": sum(chars_in_place(i, t) for i, t in pairs) / len(pairs)})
    return rows


def table(rows: list[dict]) -> str:
    """The rows of :func:`score` as the table ``dayzero eval`` prints."""
    lines = [f"{'task':<12} {'n':>5} {'correct':>8} {'accuracy':>9}  {'95% interval':>15}  {'chars in place':>14}"]
    for r in rows:
        lines.append(f"{r['task']:<12} {r['n']:>5} {r['correct']:>8} {r['accuracy']:>9.1%}  "
                     f"{r['low']:>6.1%} – {r['high']:>6.1%}  {r['chars']:>14.1%}")
    return "\n".join(lines)


def _modes(args) -> int:
    from dayzero.engine.engine import DEFAULT_MODEL
    from dayzero.engine.tokenizer import load_tokenizer

    base = engine_kwargs(args)
    tokenizer = load_tokenizer(base.get("model") or DEFAULT_MODEL)
    insts = build(args, tokenizer)
    count = lambda text: len(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731

    def ask(llm, xs):  # each mode's engine, its own context length checked first
        check_fits(xs, llm.tokenizer, llm.engine.max_model_len, args.context_len)
        return answers(llm, xs, sys.stderr.isatty(), chat_format(args))

    runs = []
    for name in mode_names(args.modes):
        note(f"mode {name}: {MODES[name].what}")
        runs.append(run_mode(MODES[name], base, insts, ask, max_answer_tokens, count))
    first = runs[0].texts
    table = [{"mode": r.mode.name, "what": r.mode.what, "engine": r.engine, "tasks": score(insts, r.texts),
              "same_as_first": sum(a == b for a, b in zip(r.texts, first)) / len(first),
              "preemptions": r.preemptions, "prefix_hit": r.prefix_hit} for r in runs]
    target = base.get("model") or str(DEFAULT_MODEL)
    if args.json:
        print(json.dumps({"target": target, "task_seed": args.task_seed, "context_len": args.context_len,
                          "n": args.n, "modes": table}))
        return 0
    tasks = [row["task"] for row in table[0]["tasks"]]
    print(f"{target}: exact match, greedy, task seed {args.task_seed}, {args.n} instances a task")
    width = max(12, *map(len, tasks))
    print(f"{'mode':<14}" + "".join(f"{t:>{width}}" for t in tasks) + f"  {'same as ' + runs[0].mode.name:>16}  notes")
    for row, r in zip(table, runs):
        same = "—" if r is runs[0] else f"{row['same_as_first']:.1%}"
        print(f"{row['mode']:<14}" + "".join(f"{t['accuracy']:>{width}.1%}" for t in row["tasks"])
              + f"  {same:>16}  {r.note()}")
    return 0


def run(args) -> int:
    check_options(args)
    if getattr(args, "modes", None) is not None:
        return _modes(args)
    insts, texts, target = (_in_process if args.url is None else _over_http)(args)
    rows = score(insts, texts)
    if args.json:
        outputs = [{"task": i.task, "answer": i.answer, "output": t, "correct": correct(i, t),
                    "chars": chars_in_place(i, t)} for i, t in zip(insts, texts)]
        print(json.dumps({"target": target, "task_seed": args.task_seed, "context_len": args.context_len,
                          "format": args.format, "tasks": rows, "outputs": outputs}))
        return 0
    style = f", recall {recall_style(args)}" if "recall" in _task_names(args.tasks) else ""
    print(f"{target}: exact match, greedy, task seed {args.task_seed}{style}{FORMATS[args.format]}")
    print(table(rows))
    return 0
