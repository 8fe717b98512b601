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


def configure_logging(*, json_output: bool | None = None, level: str = "info", stream=None) -> None:
    """Configure structlog once per process. ``json_output=None`` picks JSON unless on a TTY."""
    if json_output is None:
        json_output = not (stream or sys.stderr).isatty()
    stream = stream or _CurrentStderr()
    renderer = structlog.processors.JSONRenderer() if json_output else structlog.dev.ConsoleRenderer(colors=False)
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
