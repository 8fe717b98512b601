"""structlog set-up: JSON lines for daemons, a readable console format on a terminal."""
from __future__ import annotations

import logging
import sys

import structlog


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is when a line is logged, not the object it was at set-up
    (a test's captured stream, closed after the test, would break every later log line)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def render_brief(_logger: object, _method: str, event_dict: dict) -> str:
    """One line aligned like ``ddloco up``'s own (``redis      embedded at ...``): a 10-column head
    (the level when above info, else the component, else ``log``), the event, its fields; no
    timestamp (a person reads it as it happens)."""
    level = event_dict.pop("level", "info")
    event_dict.pop("timestamp", None)
    event = event_dict.pop("event", "")
    head = level if level not in ("info", "debug") else event_dict.pop("component", "log")
    fields = " ".join(f"{k}={v!r}" if isinstance(v, str) and (" " in v or not v) else f"{k}={v}"
                      for k, v in event_dict.items())
    return f"{head:<10} {event}" + (f" {fields}" if fields else "")


def configure_logging(*, json_output: bool | None = None, level: str = "info", stream=None,
                      brief: bool = False) -> None:
    """Configure structlog once per process. ``json_output=None`` picks JSON unless on a TTY;
    ``brief``: ``render_brief``'s lines whatever the output (a tool's own process, for a person)."""
    if json_output is None:
        json_output = not (stream or sys.stderr).isatty()
    stream = stream or _CurrentStderr()
    renderer = (render_brief if brief else structlog.processors.JSONRenderer() if json_output
                else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )


def get_logger(component: str, **context):
    return structlog.get_logger().bind(component=component, **context)
