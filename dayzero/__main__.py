"""``python -m dayzero``: the ``dayzero`` command line."""
import sys

from dayzero.cli import main

sys.exit(main())
