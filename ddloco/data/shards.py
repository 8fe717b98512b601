"""The last step of ``ddloco data prepare``: the finished parts copied, in input order, into shard
files of bounded size (``train-NNNNN.bin``, ``heldout-NNNNN.bin``), each written atomically; then
the index. The copy streams through fixed-size chunks read from the part: RAM stays flat.
"""
from __future__ import annotations

import os
from typing import BinaryIO

import numpy as np

from ddloco.data.index import shard_name

COPY_TOKENS = 1 << 24


class ShardWriter:
    """Token ids appended to ``OUT/<split>-NNNNN.bin`` files of at most ``shard_tokens`` each."""

    def __init__(self, out: str, split: str, shard_tokens: int):
        self.out, self.split, self.shard_tokens = out, split, shard_tokens
        self.shards: list[dict] = []
        self._file: BinaryIO | None = None
        self._tmp = ""

    def _open_next(self) -> None:
        name = shard_name(self.split, len(self.shards))
        self._tmp = os.path.join(self.out, f".{name}.tmp{os.getpid()}")
        self._file = open(self._tmp, "wb")
        self.shards.append({"file": name, "tokens": 0})

    def _close_current(self) -> None:
        if self._file is not None:
            self._file.close()
            os.replace(self._tmp, os.path.join(self.out, self.shards[-1]["file"]))
            self._file = None

    def append(self, ids: np.ndarray) -> None:
        while len(ids):
            if self._file is None or self.shards[-1]["tokens"] >= self.shard_tokens:
                self._close_current()
                self._open_next()
            room = self.shard_tokens - self.shards[-1]["tokens"]
            ids[:room].tofile(self._file)
            self.shards[-1]["tokens"] += len(ids[:room])
            ids = ids[room:]

    def close(self) -> list[dict]:
        """Finish the last shard; the shard entries of the index."""
        self._close_current()
        return self.shards


def copy_range(part: str, dtype: str, start: int, stop: int, writer: ShardWriter) -> None:
    """Tokens ``start:stop`` of a part file into ``writer``, a chunk at a time."""
    if stop <= start:
        return
    itemsize = np.dtype(dtype).itemsize
    with open(part, "rb") as f:
        f.seek(start * itemsize)
        for lo in range(start, stop, COPY_TOKENS):
            writer.append(np.fromfile(f, dtype=dtype, count=min(stop, lo + COPY_TOKENS) - lo))
