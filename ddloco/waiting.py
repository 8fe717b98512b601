"""One way for the tools to wait on observed state: poll a predicate until it returns something
truthy, or raise TimeoutError naming what was awaited (benches, `make slurm-check`); the loop is
common.retry's, as the tests' ``wait_until`` is."""
from __future__ import annotations

from typing import Any, Callable

from common import retry


def wait_for(pred: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.1) -> Any:
    """``pred()``'s first truthy value, polled every ``every_s`` for up to ``timeout_s`` seconds."""
    value = retry.until(lambda: pred() or None, retry.Deadline.after(timeout_s), interval_s=every_s)
    if value is None:
        raise TimeoutError(f"{what}: not within {timeout_s:g} s")
    return value
