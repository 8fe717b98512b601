"""A daemon's start-up without the optional packages its libraries load and it never uses.

redis-py (7+) imports the OpenTelemetry SDK's metrics whenever that is installed (``wandb`` pulls
it in), for an instrumentation a daemon never turns on; structlog imports ``rich`` for the console
renderer's tracebacks, which a daemon writing JSON lines never draws. Together ~0.08 s of CPU at
every start: a learner that Slurm or Kubernetes starts again on a busy host waits ~2 × that
(docs/results/failures.md, "Where a restarted learner's time goes"). ``lean_start`` imports both
libraries first with those optional modules looking absent to them, then makes them importable
again for anything else in the process. ``DDLOCO_FULL_IMPORTS=1`` turns it off (e.g. to use
redis-py's OpenTelemetry metrics inside a daemon).

A learner also imports with Python's cyclic garbage collector paused (``pause_gc`` /
``resume_gc``): a learner's imports make ~3 × 10^5 tracked objects, nearly all of them module
state, yet the collector walks them again and again as they are made (0.09-0.13 s of the ~0.95 s of
CPU of a bare ``import torch`` here). Once the imports are done their objects are moved out of the
collector's sight for good (``gc.freeze``), so later collections on the training thread walk only
what training makes; the collector runs as usual from then on. The price: the cycles the imports
left behind (~7,600 objects here; collecting them first costs more than the pause saves) are
frozen with the rest and live as long as the process, as do any made while a learner waits for
its run's config before ``Joining._prepare`` ends the pause.

And numpy's OpenBLAS (which ``import torch`` loads with numpy) starts one thread per core at import
that spins for work it never gets: a daemon never multiplies matrices with numpy (torch has its
own BLAS); a bare ``import torch`` with the collector paused took 0.80-0.82 s of CPU with that pool
and 0.66-0.71 s without, on a host whose cores the learner's peers need. ``quiet_blas`` sets
``OPENBLAS_NUM_THREADS=1`` in the process's environment unless it is set, so the learner's own
child processes and its task's code inherit it (set it yourself to keep numpy's pool).
"""
from __future__ import annotations

import gc
import importlib
import sys
from typing import Mapping, MutableMapping

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


def _full_imports(env: Mapping[str, str]) -> bool:
    """``DDLOCO_FULL_IMPORTS=1``: a start as the libraries make it, none of this module's changes."""
    return env.get("DDLOCO_FULL_IMPORTS") == "1"


def lean_start(env: Mapping[str, str], *, json_logs: bool) -> None:
    """A daemon's first imports of redis and structlog, without what it never uses (module doc)."""
    if _full_imports(env):
        return
    import_without("redis", REDIS_OPTIONAL)
    if json_logs:
        import_without("structlog", STRUCTLOG_OPTIONAL)


_gc_paused = False


def quiet_blas(env: MutableMapping[str, str]) -> bool:
    """numpy's OpenBLAS without its idle thread pool (module doc), unless ``OPENBLAS_NUM_THREADS``
    is set or ``DDLOCO_FULL_IMPORTS=1``; before numpy is imported (after, it changes nothing).
    True: set here."""
    if _full_imports(env) or "OPENBLAS_NUM_THREADS" in env or "numpy" in sys.modules:
        return False
    env["OPENBLAS_NUM_THREADS"] = "1"
    return True


def pause_gc(env: Mapping[str, str]) -> bool:
    """Pause the cyclic garbage collector for a process's imports (module doc); ``resume_gc`` ends
    the pause. False: nothing done (``DDLOCO_FULL_IMPORTS=1``, or the collector was off already)."""
    global _gc_paused
    if _full_imports(env) or not gc.isenabled():
        return False
    gc.disable()
    _gc_paused = True
    return True


def resume_gc() -> None:
    """After the imports: their objects out of every later collection, the collector on again.
    A no-op unless ``pause_gc`` paused it (a forked or embedded learner: nothing to do)."""
    global _gc_paused
    if _gc_paused:
        _gc_paused = False
        gc.freeze()
        gc.enable()
