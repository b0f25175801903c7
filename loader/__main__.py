"""``python -m kload``: the command line (kload.doors.cli)."""
import sys

from .doors.cli import main

if __name__ == "__main__":
    sys.exit(main())
