"""The cluster flags a tool shares with the daemons, and the config they resolve to in this
process's environment (a tool is an entry point: it may read it).

    add_common(parser, "status")        # --config --run-id --redis-url --keys ... (common.flags)
    cfg = resolve(args)                 # ConfigFile: TOML, flags, DDLOCO_REDIS_URL / DDLOCO_KEYS
"""
from __future__ import annotations

import argparse
import os
from typing import Iterable

from common import command
from common.config import ConfigFile
from common.flags import Flag, add_common

__all__ = ["add_common", "resolve"]


def resolve(args: argparse.Namespace, flags: Iterable[Flag] = ()) -> ConfigFile:
    """``common.command.resolve`` with this process's environment."""
    return command.resolve(args, os.environ, flags)
