"""``dayzero eval`` and its tasks: seeded instances whose answers are right by construction, held-out streams
apart from the training one, recall prompts sized by the tokenizer with the key far back, the 95% interval, the
scoring through the engine (answers planted in the engine's output), a run in process and against a server, and
the inputs it refuses."""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from dayzero import LLM
from dayzero.cli import main
from dayzero.eval import tasks as T
from dayzero.tools import eval_cli
from tests.server.conftest import API_KEY, ServerProcess


def test_instances_are_seeded_and_their_answers_right():
    for task in T.TASKS:
        a = T.instances(task, 20, "eval", seed=3, context_len=300)
        assert a == T.instances(task, 20, "eval", seed=3, context_len=300)  # regenerated alike
        assert a != T.instances(task, 20, "train", seed=3, context_len=300)  # another stream
        assert a != T.instances(task, 20, "eval", seed=4, context_len=300)
    for inst in T.instances("addition", 50, max_digits=5):
        x, y = map(int, re.fullmatch(r"(\d+)\+(\d+)=", inst.prompt).groups())
        assert int(inst.answer) == x + y and max(len(str(x)), len(str(y))) <= 5
    for inst in T.instances("subtraction", 50):
        x, y = map(int, re.fullmatch(r"(\d+)-(\d+)=", inst.prompt).groups())
        assert int(inst.answer) == x - y
    for inst in T.instances("reversal", 50):
        s = re.fullmatch(r"reverse ([a-z]+) =", inst.prompt).group(1)
        assert inst.answer == s[::-1] and len(s) <= 24
    for inst in T.instances("sorting", 50):
        s = re.fullmatch(r"sort ([a-z]+) =", inst.prompt).group(1)
        assert inst.answer == "".join(sorted(s))
    for inst in T.instances("copy", 10):
        assert inst.prompt == f"copy: {inst.answer}\n="


def test_recall_puts_the_asked_pair_in_the_first_half_of_a_prompt_of_about_the_asked_length(tiny_ckpt):
    tok = LLM(str(tiny_ckpt), device="cpu", dtype="float32", num_cache_blocks=8).tokenizer
    count = lambda text: len(tok.encode(text, add_special_tokens=False))  # noqa: E731
    for inst in T.instances("recall", 10, context_len=1024, count=count):  # keys of one capital letter
        key = re.fullmatch(r".*\nWhat is ([A-Z])\? \1=", inst.prompt, re.S).group(1)
        at = re.search(rf"(?<![A-Za-z]){key}={inst.answer}\.", inst.prompt).start()
        assert at < len(inst.prompt) / 2
        assert 0.8 * 1024 <= count(inst.prompt) <= 1.2 * 1024


def test_recall_styles_write_the_same_pairs_and_filler_two_ways():
    """The sentence style (the first checkpoints' format) draws the same pairs and asks for the same one (the filler
    differs: its length counts the pairs' text)."""
    for new, old in zip(T.instances("recall", 5, context_len=300, style="assign"),
                        T.instances("recall", 5, context_len=300, style="sentence")):
        assert new.answer == old.answer
        pairs = re.findall(r"(?<![a-z])([a-z]{4})=(\d{4})\.", new.prompt)
        assert pairs and sorted(pairs) == sorted(re.findall(r"The value of ([a-z]{4}) is (\d{4})\.", old.prompt))
        key = re.search(r"What is the value of ([a-z]{4})\? The value of \1 is $", old.prompt).group(1)
        assert (key, new.answer) in pairs and new.prompt.endswith(f"{key}=")
    for one, drill in zip(T.instances("recall", 5, "train", context_len=300, min_pairs=2, style="assign"),
                          T.instances("recall", 5, "train", context_len=300, min_pairs=2, questions=4,
                                      style="assign")):
        assert drill.prompt == one.prompt and drill.answer.startswith(one.answer + "\n")  # the first question as ever
        pairs = dict(re.findall(r"(?<![a-z])([a-z]{4})=(\d{4})\.", one.prompt))
        asked = re.findall(r"\nWhat is ([a-z]{4})\? \1=(\d{4})", "\n" + drill.prompt.split("\n")[-1] + drill.answer)
        assert len(asked) == min(4, len(pairs)) and len({k for k, _ in asked}) == len(asked)
        assert all(pairs[k] == v for k, v in asked)  # every question answered with its pair's value
    for new, letter in zip(T.instances("recall", 5, context_len=300, style="assign"),
                           T.instances("recall", 5, context_len=300)):  # letter, the default
        # keys of one capital letter (the random draws differ from four-letter keys': other values)
        pairs = re.findall(r"(?<![A-Za-z])([A-Z])=(\d{4})\.", letter.prompt)
        assert len(pairs) == len(re.findall(r"(?<![a-z])([a-z]{4})=(\d{4})\.", new.prompt))
        assert len({k for k, _ in pairs}) == len(pairs)  # distinct keys
        key = re.search(r"\nWhat is ([A-Z])\? \1=$", letter.prompt).group(1)
        assert (key, letter.answer) in pairs
        assert not re.search(r"[A-Z]", re.sub(r"(?<![A-Za-z])[A-Z]=\d{4}\.|\nWhat is [A-Z]\? [A-Z]=$", "",
                                               letter.prompt).replace("What", ""))  # no capital in the filler
    for joined, letter in zip(T.instances("recall", 5, context_len=300, style="joined"),
                              T.instances("recall", 5, context_len=300)):
        # the same keys, values and filler, each value right after its key: `K1234.`, asked with `K`
        assert joined.answer == letter.answer
        assert joined.prompt == re.sub(r"(?<![A-Za-z])([A-Z])=", r"\1", letter.prompt)
        assert re.search(rf"(?<![A-Za-z])([A-Z]){joined.answer}\.", joined.prompt).group(1) == joined.prompt[-1]
    with pytest.raises(ValueError, match="recall style"):
        T.instances("recall", 1, style="verse")


def test_wilson_interval_matches_published_values():
    assert eval_cli.wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert eval_cli.wilson(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    assert eval_cli.wilson(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert eval_cli.wilson(81, 263) == pytest.approx((0.2553, 0.3662), abs=1e-4)


def run_planted(monkeypatch, capsys, argv, text) -> tuple[dict, list]:
    """``dayzero eval`` with ``argv`` (``--json``), each engine's real outputs replaced after it ran by
    ``text(config, k, answer)`` for the k-th prompt of a ``generate`` call: (the report, each call's engine config)."""
    from dayzero.cli import build_parser

    real, configs = LLM.generate, []
    args = build_parser().parse_args(argv)

    def planted(self, prompts, params, use_tqdm=False):
        outs = real(self, prompts, params)
        configs.append(self.engine.config)
        by_prompt = {i.prompt: i.answer for i in eval_cli.build(args, self.tokenizer)}
        for k, (p, o) in enumerate(zip(prompts, outs)):
            o.outputs[0].text = text(self.engine.config, k, by_prompt[p])
        return outs

    monkeypatch.setattr(LLM, "generate", planted)
    assert main(argv) == 0
    monkeypatch.setattr(LLM, "generate", real)
    return json.loads(capsys.readouterr().out), configs


def test_scores_count_exact_answers_through_the_engine(tiny_ckpt, monkeypatch, capsys):
    """The engine's outputs replaced by the right answer for every other instance (and a near miss for the
    rest): accuracy is exactly half per task, a trailing space or newline still counts."""
    argv = ["eval", str(tiny_ckpt), "--device", "cpu", "--dtype", "float32", "--n", "6", "--tasks",
            "addition,reversal,recall", "--context-len", "128", "--json"]
    report, _ = run_planted(monkeypatch, capsys, argv, lambda c, k, answer: answer + (" " if k % 2 == 0 else "0"))
    assert [r["task"] for r in report["tasks"]] == ["addition", "reversal", "recall"]
    for r in report["tasks"]:
        assert (r["n"], r["correct"], r["accuracy"]) == (6, 3, 0.5)
        assert r["low"] < 0.5 < r["high"]
        mine = [o for o in report["outputs"] if o["task"] == r["task"]]
        # partial credit: the near misses have every answer character in place and one more
        assert [o["chars"] for o in mine] == [1.0 if o["correct"] else len(o["answer"]) / (len(o["answer"]) + 1)
                                              for o in mine]
        assert r["chars"] == pytest.approx(sum(o["chars"] for o in mine) / 6)
    assert eval_cli.chars_in_place(T.Instance("recall", "", "1234"), "1934\n") == 0.75
    assert eval_cli.chars_in_place(T.Instance("recall", "", "1234"), "12") == 0.5


def test_modes_run_an_engine_each_and_compare_it_with_the_first(tiny_ckpt, monkeypatch, capsys):
    """``--modes``: every mode builds its own engine from the command's options and the mode's settings; the table
    gives each task's accuracy per mode and the share of answers equal to the first mode's. Outputs planted after
    each real run: all right in the fp32 engine, every third wrong in the chunked-prefill one."""
    argv = ["eval", str(tiny_ckpt), "--device", "cpu", "--dtype", "bfloat16", "--n", "6", "--tasks",
            "addition,reversal", "--modes", "fp32,chunk16,preempt", "--json"]
    report, (fp32, chunk16, preempt) = run_planted(
        monkeypatch, capsys, argv,
        lambda c, k, answer: answer + ("0" if c.max_num_batched_tokens == 16 and k % 3 == 0 else ""))
    assert [m["mode"] for m in report["modes"]] == ["fp32", "chunk16", "preempt"]
    assert fp32.dtype == "float32" and (chunk16.max_num_batched_tokens, chunk16.max_num_seqs) == (16, 16)
    assert 0 < preempt.num_cache_blocks < 100  # the modes' own settings
    acc = [[t["accuracy"] for t in m["tasks"]] for m in report["modes"]]
    assert acc == [[1.0, 1.0], [4 / 6, 4 / 6], [1.0, 1.0]]
    assert [m["same_as_first"] for m in report["modes"]] == [1.0, 8 / 12, 1.0]
    assert report["modes"][2]["preemptions"] > 0  # a cache about the longest sequence's size: preemptions

    assert main(["eval", str(tiny_ckpt), "--device", "cpu", "--n", "2", "--tasks", "addition", "--modes",
                 "batch1,prefix"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "same as batch1" in out[1] and out[2].startswith("batch1") and out[3].startswith("prefix")
    assert "of prompt tokens from the prefix cache" in out[3]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("eval-serve"), "--num-cache-blocks", "512", api_key=API_KEY)
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.mark.parametrize("fmt", ["plain", "question"])
def test_against_a_server_as_in_process(server, capsys, fmt):
    """The same held-out instances through a running server's completions API (the bundled model, greedy) and
    through the engine in this process score the same; asked as chat messages (``--format question``: arithmetic
    in words, through the chat template), the server's chat API and ``LLM.chat`` answer alike."""
    common = ["--n", "3", "--tasks", "addition,sorting", "--format", fmt, "--json"]
    assert main(["eval", "--url", server.url, "--api-key", API_KEY, *common]) == 0
    remote = json.loads(capsys.readouterr().out)
    assert main(["eval", "--device", "cpu", *common]) == 0
    local = json.loads(capsys.readouterr().out)
    assert remote["target"].startswith(server.url)
    assert remote["tasks"] == local["tasks"]
    assert remote["outputs"] == local["outputs"] and len(local["outputs"]) == 6
    assert remote["format"] == local["format"] == fmt
    server.wait_idle()


def test_question_format_asks_arithmetic_in_words_and_leaves_other_tasks():
    common = dict(tasks="addition,subtraction,reversal", n=4, task_seed=0, max_digits=5, context_len=256,
                  recall_style="letter")
    plain = eval_cli.build(SimpleNamespace(**common, format="plain"), None)
    asked = eval_cli.build(SimpleNamespace(**common, format="question"), None)
    assert [i.answer for i in plain] == [i.answer for i in asked]
    for p, q in zip(plain, asked):
        if p.task == "reversal":
            assert q == p
        else:
            a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)=", p.prompt).groups()
            assert q.prompt == f"What is {a} {op} {b}?"


@pytest.mark.parametrize("argv,what", [
    (["--tasks", "addition,nonsense"], "--tasks"),
    (["--n", "0"], "--n"),
    (["--context-len", "8"], "--context-len"),
    (["--max-digits", "0"], "--max-digits"),
    (["--format", "verse"], "--format"),
    (["--url", "127.0.0.1:8000"], "--url"),
    (["--modes", "fp32,fp64"], "--modes: unknown mode fp64"),
    (["--modes", "fp32,fp32"], "--modes: a mode named twice"),
    (["--modes", "fp32", "--url", "http://127.0.0.1:8000"], "--modes"),
])
def test_bad_options_are_refused_with_the_option_named(argv, what, capsys):
    assert main(["eval", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    assert what in err and err.count("\n") <= 2, err


def test_the_prefix_mode_keeps_a_snapshot_of_every_first_pass_prompt():
    """The second pass runs the first one's prompts in the same order: a snapshot pool smaller than the first pass's
    snapshots would have each evicted (least recently used) before it is asked for again."""
    from dayzero.eval.modes import MODES

    insts = [T.Instance("addition", "1+1=", "2")] * 70 + [T.Instance("recall", "w " * 1100, "1234")] * 3
    count = lambda text: len(text.split())  # noqa: E731
    kw = MODES["prefix"].kwargs({"device": "cpu"}, insts, count, eval_cli.max_answer_tokens)
    assert kw["num_prefix_snapshots"] == 70 + 3 * 3 and kw["enable_prefix_caching"]
    assert MODES["prefix"].kwargs({"num_prefix_snapshots": 5}, insts, count, len)["num_prefix_snapshots"] == 5
    assert "num_prefix_snapshots" not in MODES["bf16"].kwargs({}, insts, count, len)


def test_recall_is_asked_in_the_style_the_models_card_records(tmp_path):
    """Without ``--recall-style`` the prompts follow the style the model learnt, as its card records (the
    bundled model: joined); a checkpoint without a card, or with a card from before the styles, gets letter."""
    from dayzero.engine.engine import DEFAULT_MODEL
    from dayzero.train.card import card_results, trained_recall_style

    common = dict(tasks="recall", n=3, task_seed=0, max_digits=5, context_len=256, format="plain")
    bundled = card_results(DEFAULT_MODEL)["recall_style"]
    assert trained_recall_style(DEFAULT_MODEL) == bundled == "joined"
    joined = eval_cli.build(SimpleNamespace(**common, model=str(DEFAULT_MODEL), recall_style=None), None)
    assert all(re.search(r"[A-Z]\d{4}\.", i.prompt) and not i.prompt.endswith("=") for i in joined)
    (tmp_path / "README.md").write_text('---\ndayzero_eval: {"accuracy": {}}\n---\n')  # a card without the style
    for model in (tmp_path, tmp_path / "absent"):
        assert trained_recall_style(model) == "letter"
        letter = eval_cli.build(SimpleNamespace(**common, model=str(model), recall_style=None), None)
        assert all(i.prompt.endswith("=") for i in letter)
    asked = eval_cli.build(SimpleNamespace(**common, model=str(tmp_path), recall_style="joined"), None)
    assert [i.prompt for i in asked] == [i.prompt for i in joined]  # the option wins over the card


def test_recall_prompts_past_the_context_length_are_refused_before_any_runs(tiny_ckpt, capsys):
    """A recall prompt longer than the engine's context length is named with the option that makes room, before
    the first prompt runs; with that option the same command runs."""
    argv = ["eval", str(tiny_ckpt), "--device", "cpu", "--dtype", "float32", "--n", "2", "--tasks", "recall",
            "--context-len", "600", "--max-model-len", "512", "--json"]
    assert main(argv) != 0
    err = capsys.readouterr().err
    found = re.search(r"recall prompts of --context-len 600 reach (\d+) tokens .* past the engine's context length "
                      r"of 512: pass --max-model-len (\d+)", err)
    assert found, err
    assert int(found.group(2)) >= int(found.group(1)) + 64
    assert main(argv[:-3] + ["--max-model-len", found.group(2), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tasks"][0]["n"] == 2
