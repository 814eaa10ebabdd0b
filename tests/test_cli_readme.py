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
