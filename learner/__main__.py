"""`python -m learner`: same as `ddloco learner`."""
import sys

from ddloco.cli import main

if __name__ == "__main__":
    sys.exit(main(["learner", *sys.argv[1:]]))
