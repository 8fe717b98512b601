"""Files written so that a reader (or a crash) never sees half of one: the one atomic-write helper.

    with atomic_path(path, durable=True) as tmp:   # write anything to ``tmp``
        torch.save(state, tmp)
    write_atomic(path, "text or bytes")            # the short form

The data goes to a temporary file next to ``path`` (same filesystem), then ``os.replace`` puts it
in place in one step. ``durable=True`` also fsyncs the file and its directory, so the new file
survives a power cut (checkpoints); without it a crash leaves the old file or the new one, never a
mix. On any error the temporary file is removed and the old file is left as it was.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], *, durable: bool = False) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on a clean exit rename it over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        if durable:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if durable:
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def write_atomic(path: str | os.PathLike[str], data: str | bytes, *, durable: bool = False) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` atomically; returns the path."""
    with atomic_path(path, durable=durable) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    return Path(path)


def read_env_file(path: str | os.PathLike[str]) -> dict[str, str]:
    """KEY=VALUE lines (``runs/<run>/access.env``, a ``*.redis.env``); blank lines and ``#``
    comments skipped."""
    out = {}
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out
