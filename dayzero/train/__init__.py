"""Training the engine's own models on the synthetic tasks of :mod:`dayzero.eval.tasks` (docs/training.md).

``batch`` (whole fresh sequences, functional caches), ``forward`` (the training mode and the losses), the ops of
the ``train`` platform (``linear_attention``, ``attention``, ``routing``), ``data`` (tasks into steps),
``loop`` (the optimiser and schedule), ``checkpoint`` (models in, checkpoints out), ``evaluate`` (held-out
accuracy through the engine).
"""
