"""A daemon's start-up without the optional packages its libraries load and it never uses.

redis-py (7+) imports the OpenTelemetry SDK's metrics whenever that is installed (``wandb`` pulls
it in), for an instrumentation a daemon never turns on; structlog imports ``rich`` for the console
renderer's tracebacks, which a daemon writing JSON lines never draws. Together ~0.08 s of CPU at
every start: a learner that Slurm or Kubernetes starts again on a busy host waits ~2 × that
(docs/results/failures.md, "Where a restarted learner's time goes"). ``lean_start`` imports both
libraries first with those optional modules looking absent to them, then makes them importable
again for anything else in the process. ``DDLOCO_FULL_IMPORTS=1`` turns it off (e.g. to use
redis-py's OpenTelemetry metrics inside a daemon).
"""
from __future__ import annotations

import importlib
import sys
from typing import Mapping

REDIS_OPTIONAL = ("opentelemetry.sdk.metrics",)
STRUCTLOG_OPTIONAL = ("rich",)


def import_without(module: str, optional: tuple[str, ...]) -> bool:
    """Import ``module`` while the ``optional`` modules (not imported yet) look absent to it; they
    import normally afterwards. False: ``module`` was imported already (nothing done)."""
    if module in sys.modules:
        return False
    hidden = [name for name in optional if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None   # type: ignore[assignment]   # `import name` raises ImportError
    try:
        importlib.import_module(module)
    except ImportError:
        pass   # the module's own import error comes where it is used
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]
    return True


def lean_start(env: Mapping[str, str], *, json_logs: bool) -> None:
    """A daemon's first imports of redis and structlog, without what it never uses (module doc)."""
    if env.get("DDLOCO_FULL_IMPORTS") == "1":
        return
    import_without("redis", REDIS_OPTIONAL)
    if json_logs:
        import_without("structlog", STRUCTLOG_OPTIONAL)
