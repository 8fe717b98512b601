"""`python -m syncer`: same as `ddloco syncer`."""
import sys

from ddloco.cli import main

if __name__ == "__main__":
    sys.exit(main(["syncer", *sys.argv[1:]]))
