"""A benchmark script run again on another package (an earlier version, or other settings), for ratios measured
side by side in one job: the script writes its numbers to ``--json FILE``, which the caller reads back."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile


def run_on(script: str, args: list[str], package: str | None = None, settings: dict[str, str] | None = None,
           what: str = "") -> dict | None:
    """``script args --json FILE`` in a new process with ``package`` (a directory holding an earlier ``dayzero``)
    first on the path, the rest of the path kept (kernel packages: fla), and the environment ``settings``; its
    JSON, or None when it failed."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    env = dict(os.environ)
    if package:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (os.path.abspath(package), env.get("PYTHONPATH", ""))))
    env.update(settings or {})
    print(f"baseline ({what or package or 'this version'}):", flush=True)
    if subprocess.run([sys.executable, os.path.abspath(script), *args, "--json", out], env=env).returncode != 0:
        print("baseline run failed", flush=True)
        return None
    with open(out) as f:
        return json.load(f)
