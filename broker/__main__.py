"""`python -m broker`: same as `ddloco broker` (its parser is broker/cli.py; no import of ddloco)."""
import sys

from broker.cli import main

if __name__ == "__main__":
    sys.exit(main())
