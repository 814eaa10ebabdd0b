"""Per-shape kernel choices kept in tables, one per GPU model, so that a build need not time them again.

The skinny and fused linears pick, per (rows bucket, shape, dtypes) key, a Triton block shape or the ops apart
by timing every candidate (:func:`dayzero.ops.linear.kernels.measure_once`). Each candidate must compile before
it can be timed: on a fresh machine those compiles, not the timing, are a large part of an engine's build (~130
keys of 3-7 candidates each for dayzero-small; on the H100 its build took 281.5 s measuring every key and 171.5 s
reading them from a table, ``python benchmarks/choice_table.py``). A choice table records the choices measured on
one GPU model; a later build on that model takes a key's choice from it, so only the chosen blocks compile.

Two tables are read, the first that has a key wins:

- the user's, ``$DAYZERO_CACHE_DIR/choices/`` (default ``~/.cache/dayzero/choices/``), a file per GPU model and
  kernels' digest: every choice measured in any process is added to it, so a machine times each key once;
- the package's, ``dayzero/ops/choice_tables/`` (``python benchmarks/choice_table.py`` writes one on the GPU it
  runs on).

A table holds only for the kernels it was measured with: it records a digest of the sources that define the
timed kernels, their candidates and the timing (:data:`SOURCES`), with Triton's version, and one whose digest
differs is not read (logged once). A choice is also read only in the form a measurement returns (a block of 3 or 4
positive ints, or None). ``DAYZERO_CHOICES=measure`` times every key again and reads no table (it still adds to
the user's); ``DAYZERO_CHOICES=off`` neither reads nor writes one. A table that cannot be read is skipped with a
warning and its keys measured; a cache folder that cannot be written is warned about once, the build goes on.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("dayzero.ops")

OPS = Path(__file__).parent
PACKAGE_TABLES = OPS / "choice_tables"
# the sources a measured choice depends on: the timed kernels (skinny linear and its fused launches, the router's
# one launch), the kernels their "apart" side runs, the candidates and the timing itself
SOURCES = ("linear/kernels.py", "linear/norm.py", "linear/act.py", "linear/reference.py", "moe/router_kernels.py",
           "moe/route_kernels.py", "activation/kernels.py", "norm/kernels.py", "triton_support.py", "static.py")
MODES = ("table", "measure", "off")


def mode() -> str:
    """``DAYZERO_CHOICES``: table (default), measure or off; ValueError naming the value otherwise."""
    value = os.environ.get("DAYZERO_CHOICES", "table") or "table"
    if value not in MODES:
        raise ValueError(f"DAYZERO_CHOICES={value!r}: expected one of {', '.join(MODES)}")
    return value


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


@functools.lru_cache(maxsize=4)
def digest_with(triton: str | None) -> str:
    """The digest of the :data:`SOURCES` with Triton version ``triton`` (None: no Triton): the check of a shipped
    table, which records the version it was measured with."""
    h = hashlib.sha256()
    for name in SOURCES:
        h.update(name.encode())
        h.update((OPS / name).read_bytes())
    if triton is not None:
        h.update(triton.encode())
    return h.hexdigest()[:16]


def digest() -> str:
    """The digest a table must record to be read here: the :data:`SOURCES` and the installed Triton's version."""
    return digest_with(triton_version())


def file_name(device_name: str, suffix: str = "") -> str:
    """The table's file name for a GPU model: ``NVIDIA H200`` -> ``nvidia-h200{suffix}.json``."""
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") + suffix + ".json"


def user_dir() -> Path:
    return Path(os.environ.get("DAYZERO_CACHE_DIR") or Path.home() / ".cache" / "dayzero") / "choices"


def key_text(op: str, key: tuple) -> str:
    """A choice's key as a table writes it: the op, then the key's values (dtypes by name; the device left out, as
    a table is for one GPU model)."""
    def text(v) -> str:
        return str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else str(v)

    return op + ":" + ",".join(text(v) for v in key if not isinstance(v, torch.device))


def valid(value) -> bool:
    """Whether a table's value has a measured choice's form: None (the ops apart, or cuBLAS) or a block shape of 3
    or 4 positive ints."""
    return value is None or (isinstance(value, list) and len(value) in (3, 4)
                             and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value))


def read(path: Path, device_name: str) -> dict:
    """The choices of the table at ``path`` when it was measured on ``device_name`` with these kernels, else {}; a
    table that cannot be read, or that holds entries of another form, is skipped with a warning."""
    if not path.exists():
        return {}
    try:
        table = json.loads(path.read_text())
        choices = table["choices"]
        if not isinstance(choices, dict):
            raise ValueError("'choices' is not an object")
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("choice table %s cannot be read (%s: %s): its keys are measured", path, type(e).__name__, e)
        return {}
    if table.get("device") != device_name:
        log.warning("choice table %s was measured on %s, not %s: not read", path, table.get("device"), device_name)
        return {}
    if table.get("digest") != digest():
        log.info("choice table %s was measured with other kernels (digest %s, these %s): not read", path,
                 table.get("digest"), digest())
        return {}
    bad = [k for k, v in choices.items() if not valid(v)]
    if bad:
        log.warning("choice table %s has %d entries of another form (first %s = %r): not read", path, len(bad),
                    bad[0], choices[bad[0]])
        return {}
    return choices


class ChoiceTables:
    """The tables of one GPU model: :meth:`get` a key's choice (found, value), :meth:`add` a measured one."""

    def __init__(self, device_name: str, user: Path | None = None, package: Path = PACKAGE_TABLES):
        self.device_name = device_name
        # one file per digest: processes of two versions of the kernels (a side-by-side benchmark) keep theirs
        self.path = (user or user_dir()) / file_name(device_name, f"-{digest()}")
        self.mode = mode()
        self.found = self.measured = 0
        self._warned = False
        self.choices: dict = {}
        if self.mode == "table":
            self.choices = {**read(package / file_name(device_name), device_name),
                            **read(self.path, device_name)}

    def get(self, op: str, key: tuple) -> tuple[bool, tuple | None]:
        text = key_text(op, key)
        if text not in self.choices:
            return False, None
        self.found += 1
        value = self.choices[text]
        return True, None if value is None else tuple(value)

    def add(self, op: str, key: tuple, value: tuple | None) -> None:
        """Record a measured choice in the user's table (merged with what other processes wrote meanwhile)."""
        self.measured += 1
        if self.mode == "off":
            return
        text = key_text(op, key)
        self.choices[text] = None if value is None else list(value)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            on_disk = read(self.path, self.device_name)
            on_disk[text] = self.choices[text]
            table = {"device": self.device_name, "digest": digest(), "torch": torch.__version__,
                     "triton": triton_version(), "choices": dict(sorted(on_disk.items()))}
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(table, f, indent=0)
            os.replace(tmp, self.path)
        except OSError as e:
            if not self._warned:
                log.warning("choice table %s cannot be written (%s: %s): choices are measured again in the next "
                            "process", self.path, type(e).__name__, e)
                self._warned = True


_TABLES: dict[str, ChoiceTables] = {}


def tables(device: torch.device) -> ChoiceTables:
    """The tables of ``device``'s GPU model (read once a process)."""
    name = torch.cuda.get_device_name(device)
    if name not in _TABLES:
        _TABLES[name] = ChoiceTables(name)
    return _TABLES[name]


def summary(device: torch.device) -> str | None:
    """A line on where this process's per-shape choices on ``device`` came from, None if it made none."""
    store = _TABLES.get(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    if store is None or not store.found + store.measured:
        return None
    return (f"per-shape kernel choices on {store.device_name}: {store.found} from the choice tables, "
            f"{store.measured} measured (DAYZERO_CHOICES={store.mode}; user table {store.path})")
