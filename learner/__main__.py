"""`python -m learner`: same as `ddloco learner` (its parser is learner/cli.py; no import of ddloco)."""
import sys

from learner.cli import main

if __name__ == "__main__":
    sys.exit(main())
