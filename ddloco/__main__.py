"""`python -m ddloco`: same as `ddloco`."""
import sys

from ddloco.entry import main

if __name__ == "__main__":
    sys.exit(main())
