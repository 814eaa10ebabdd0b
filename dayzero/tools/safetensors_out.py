"""Writing a safetensors file the way every other output file is written."""
from __future__ import annotations

import os
from pathlib import Path

from safetensors.torch import save_file


def current_umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it; the command line runs this single-threaded
    os.umask(mask)
    return mask


def write_safetensors(tensors: dict, path: str | Path, metadata: dict | None = None) -> None:
    """``save_file``, then the file mode an ``open()`` would give (safetensors creates its files 0600)."""
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~current_umask())
