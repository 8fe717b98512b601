"""`python -m syncer`: same as `ddloco syncer` (its parser is syncer/cli.py; no import of ddloco)."""
import sys

from syncer.cli import main

if __name__ == "__main__":
    sys.exit(main())
