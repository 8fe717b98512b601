"""The `ddloco` executable's first module: standard library only.

A command with its own parser (`ddloco learner`, `syncer`, `broker`, `bench`, ...) is handed its
arguments here without importing ``ddloco.cli``, whose parser for `up`, `status` and `keys` pulls
in every daemon's flag tables. A learner that Slurm or Kubernetes starts again pays for nothing but
its own imports on its way back into the run (docs/results/failures.md, "Where a restarted
learner's time goes").
"""
from __future__ import annotations

import sys
from typing import Sequence

from ddloco.commands import delegate


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    code = delegate(argv)
    if code is not None:
        return code
    from ddloco.cli import main as cli_main
    return cli_main(argv)
