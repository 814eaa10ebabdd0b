"""The README's command examples that claim an exit status really exit with it."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

from dayzero import cli

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_align_example_passes(tmp_path, capsys):
    m = re.search(r"Example that passes \(exit 0\): `(dayzero align [^`]*)`", README.read_text())
    assert m, "the README's align row gives a passing example"
    argv = shlex.split(m.group(1))[1:]
    argv[argv.index("--plot") + 1] = str(tmp_path / "align.png")
    rc = cli.main(argv)
    out = capsys.readouterr().out
    assert rc == 0 and out.rstrip().endswith("PASS"), out
    assert (tmp_path / "align.png").stat().st_size > 0


def test_the_first_example_answers_as_the_readme_says():
    """The README's first example: the bundled model's completion and chat reply are the commented answers."""
    from dayzero import LLM, SamplingParams

    text = README.read_text()
    prompt = re.search(r'outs = llm\.generate\(\["([^"]+)"\]', text).group(1)
    expected = re.search(r"print\(outs\[0\]\.outputs\[0\]\.text\)\s+# (\S+)", text).group(1)
    content = re.search(r'chat = llm\.chat\(\[\{"role": "user", "content": "([^"]+)"\}\]', text).group(1)
    replied = re.search(r"print\(chat\[0\]\.outputs\[0\]\.text\)\s+# (\S+)", text).group(1)
    llm = LLM(dtype="float32")
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, stop=["\n"]))
    assert out[0].outputs[0].text == expected
    chat = llm.chat([{"role": "user", "content": content}], SamplingParams(max_tokens=8, temperature=0.0))
    assert chat[0].outputs[0].text == replied
    assert chat[0].outputs[0].finish_reason == "stop"  # at the end of the assistant's turn
    sort = llm.chat([{"role": "user", "content": "sort hello ="}], SamplingParams(max_tokens=30, temperature=0.0))
    assert (sort[0].outputs[0].text, sort[0].outputs[0].finish_reason) == ("ehllo", "stop")
    assert expected == str(48213 + 3771)  # and the answer is right
