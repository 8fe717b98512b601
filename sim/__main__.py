"""`python -m sim ARGS` = `ddloco sim ARGS`."""
import sys

from sim.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
