"""``python -m omnihvd COMMAND ...``: the ``omnihvd`` command, for environments whose
scripts folder is not on PATH."""
import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
