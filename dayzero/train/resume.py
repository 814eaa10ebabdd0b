"""A training job carried over several processes (a GPU lent for minutes at a time): the job pauses, writing its
trainer state beside its checkpoint, and a later process resumes it where it stopped, as if it had never stopped.

``trainer_state.pt`` holds the model's own weights (fp32 masters: the checkpoint's MXFP4 experts are rounded),
the optimizer's moments, the step (the data stream and the schedule follow it), the seconds of training so far,
the job's time budget and the options it was started with, so that the resumed process trains the same recipe.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

STATE_FILE = "trainer_state.pt"


def save_state(out: str | Path, trainer, model, job_argv: list[str], budget: float | None) -> Path:
    """Write the state beside the checkpoint in ``out``: to a temporary file first, renamed once whole, so that a
    process stopped while writing leaves no state a resume would half-read."""
    path = Path(out) / STATE_FILE
    tmp = path.with_name(path.name + ".partial")
    torch.save({"trainer": trainer.state_dict(), "model": model.state_dict(), "argv": list(job_argv),
                "budget": budget}, tmp)
    os.replace(tmp, path)
    return path


def load_state(directory: str | Path) -> dict:
    """The state a paused job left in ``directory``; ValueError when there is none."""
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise ValueError(f"--resume {directory}: no {STATE_FILE} there (a job writes it when it pauses)")
    return torch.load(path, map_location="cpu", weights_only=False)
