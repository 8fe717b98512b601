"""The daemons' log files of a `ddloco up` run (``runs/<run>/logs/*.log``, JSON lines with a
``level``): a digest of their warnings and errors, which the person who started the run would
otherwise never see.

    warnings   shard0: syncer.answer_rejected x3, syncer.rounds_behind x1 (runs/.../logs/syncer-0.log)
    errors     learner-1: learner.redis_lost x2 (runs/.../logs/learner-1.log)

``count_problems`` (lines -> counts by level and event) and ``digest_lines`` (counts -> the
lines above) are pure; ``read_digest`` reads the files and ``print_digest`` is what ``up`` calls
at its end.
"""
from __future__ import annotations

import json
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

LEVELS = {"warning": "warning", "error": "error", "critical": "error"}
"""structlog level -> the digest's level (``log.exception`` writes ``error``)."""

TOLD_BY_UP = re.compile(r".*\.insecure")
"""Events ``up`` already told the user itself (``security   --insecure: ...``): not repeated."""

TOP_EVENTS = 3
"""Events named per daemon; the rest are counted as ``+N more``."""

MAX_DAEMONS = 8
"""Daemon lines per level; the rest are one ``and N more`` line."""


@dataclass(frozen=True)
class LogCounts:
    """One daemon's log: its warning and error lines, counted by event name."""

    daemon: str
    path: Path
    warning: Counter
    error: Counter


def count_problems(lines: Iterable[str]) -> dict[str, Counter]:
    """Warning and error lines of a JSON-lines log, counted by event: ``{"warning": Counter,
    "error": Counter}``. Lines that are not a JSON object with a ``level`` (a traceback, a
    library's own print) are skipped, and so are the events in ``TOLD_BY_UP``."""
    out: dict[str, Counter] = {"warning": Counter(), "error": Counter()}
    for line in lines:
        if not any(f'"{level}"' in line for level in LEVELS):   # most lines: no JSON parse
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        level = LEVELS.get(entry.get("level", "")) if isinstance(entry, dict) else None
        event = str(entry.get("event", "?")) if level else ""
        if level and not TOLD_BY_UP.fullmatch(event):
            out[level][event] += 1
    return out


def daemon_name(path: Path) -> str:
    """The daemon a log file belongs to, as ``up`` names it (``syncer-0.log`` -> ``shard0``)."""
    shard = re.fullmatch(r"syncer-(\d+)", path.stem)
    return f"shard{shard.group(1)}" if shard else path.stem


def digest_lines(logs: Iterable[LogCounts], level: str) -> list[str]:
    """One line per daemon with lines of ``level`` (``warning`` or ``error``), the most first:
    its top ``TOP_EVENTS`` events with their counts and the path of its log."""
    head = {"warning": "warnings", "error": "errors"}[level]
    found = sorted((lc for lc in logs if getattr(lc, level)),
                   key=lambda lc: (-sum(getattr(lc, level).values()), lc.daemon))
    out = []
    for lc in found[:MAX_DAEMONS]:
        counts = getattr(lc, level).most_common()
        events = ", ".join(f"{event} x{n}" for event, n in counts[:TOP_EVENTS])
        more = f", +{len(counts) - TOP_EVENTS} more" if len(counts) > TOP_EVENTS else ""
        out.append(f"{head:<10} {lc.daemon}: {events}{more} ({lc.path})")
    if len(found) > MAX_DAEMONS:
        out.append(f"{head:<10} and {len(found) - MAX_DAEMONS} more daemons ({found[0].path.parent})")
    return out


def read_digest(log_dir: Path) -> list[LogCounts]:
    """The counts of every ``*.log`` in ``log_dir`` (the embedded Redis's own log has no JSON lines)."""
    out = []
    for path in sorted(log_dir.glob("*.log")):
        try:
            with open(path, errors="replace") as fh:
                counts = count_problems(fh)
        except OSError:
            continue
        out.append(LogCounts(daemon_name(path), path, counts["warning"], counts["error"]))
    return out


def print_digest(log_dir: Path, say: Callable[[str], None]) -> None:
    """``up``'s end: the daemons' warnings through ``say`` (silent under --quiet), their errors
    on stderr (always)."""
    logs = read_digest(log_dir)
    for line in digest_lines(logs, "warning"):
        say(line)
    for line in digest_lines(logs, "error"):
        print(line, file=sys.stderr, flush=True)
