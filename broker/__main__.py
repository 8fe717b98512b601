"""`python -m broker`: the ZeroMQ forwarder daemon."""
import sys

from ddloco.cli import main

if __name__ == "__main__":
    sys.exit(main(["broker", *sys.argv[1:]]))
