"""The commands with a parser of their own (standard library only): `ddloco COMMAND ARGS` is
COMMAND's main(ARGS), imported on use. Both the executable's first module (``ddloco.entry``) and
``ddloco.cli`` hand these over from here."""
from __future__ import annotations

import importlib
from typing import Sequence

DELEGATED = {"learner": "learner.cli:main", "syncer": "syncer.cli:main", "broker": "broker.cli:main",
             "sim": "ddloco.sim.cli:main", "bench": "ddloco.bench.micro:main",
             "compare": "ddloco.compare.runner:cli_main", "export": "ddloco.export:main", "fuzz": "ddloco.fuzz:main", "chaos": "ddloco.chaos:main",
             "data": "ddloco.data.cli:main", "slurm": "ddloco.slurm.cli:main"}
"""Commands with their own parser: `ddloco COMMAND ARGS` is COMMAND's main(ARGS), imported on use."""


def delegate(argv: Sequence[str]) -> int | None:
    """``argv``'s command run by its own module's main (its exit code; a main returning None: 0), or
    None when ``ddloco.cli`` parses it."""
    if not argv or argv[0] not in DELEGATED:
        return None
    module, name = DELEGATED[argv[0]].split(":")
    code = getattr(importlib.import_module(module), name)(list(argv[1:]))
    return 0 if code is None else code
