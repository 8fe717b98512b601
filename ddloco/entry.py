"""The `ddloco` executable's first module: standard library only.

A command with its own parser (`ddloco learner`, `syncer`, `broker`, `bench`, ...) is handed its
arguments here without importing ``ddloco.cli``, whose parser for `up`, `status` and `keys` pulls
in every daemon's flag tables. A learner that Slurm or Kubernetes starts again pays for nothing but
its own imports on its way back into the run (docs/results/failures.md, "Where a restarted
learner's time goes").
"""
from __future__ import annotations

import importlib
import sys
from typing import Sequence

DELEGATED = {"learner": "learner.cli:main", "syncer": "syncer.cli:main", "broker": "broker.cli:main",
             "sim": "ddloco.sim.cli:main", "bench": "ddloco.bench.micro:main", "compare": "ddloco.compare.runner:cli_main",
             "export": "ddloco.export:main", "fuzz": "ddloco.fuzz:main", "chaos": "ddloco.chaos:main",
             "data": "ddloco.data.cli:main", "slurm": "ddloco.slurm.cli:main"}
"""Commands with their own parser: `ddloco COMMAND ARGS` is COMMAND's main(ARGS), imported on use."""


def delegate(argv: Sequence[str]) -> int | None:
    """``argv``'s command run by its own module's main, or None when ``ddloco.cli`` parses it."""
    if not argv or argv[0] not in DELEGATED:
        return None
    module, name = DELEGATED[argv[0]].split(":")
    return getattr(importlib.import_module(module), name)(list(argv[1:]))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    code = delegate(argv)
    if code is not None:
        return code
    from ddloco.cli import main as cli_main
    return cli_main(argv)
