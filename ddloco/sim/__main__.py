"""`python -m ddloco.sim ARGS` = `ddloco sim ARGS`."""
import sys

from ddloco.sim.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
