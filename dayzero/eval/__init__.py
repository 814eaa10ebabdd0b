"""End-to-end correctness: synthetic tasks with one right answer (``tasks``) and their exact-match accuracy
through the engine or a server (``dayzero eval``, :mod:`dayzero.tools.eval_cli`)."""
