"""One way for the tools to wait on observed state: poll a predicate until it returns something
truthy, or raise TimeoutError naming what was awaited (benches, `make slurm-check`)."""
from __future__ import annotations

import time
from typing import Any, Callable


def wait_for(pred: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.1) -> Any:
    """``pred()``'s first truthy value, polled every ``every_s`` for up to ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(every_s)
    raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
