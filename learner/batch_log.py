"""The learner's batch log (``learner.batch_log``, ``--batch-log PATH``): a line ``STREAM INDEX``
for every training batch an inner step is taken on, so a user or a test can see which batches of
each data stream were trained on, across restarts and joins (docs/architecture.md, "Data
position").

One unbuffered ``write`` per line on a file opened with O_APPEND: a line written survives a
SIGKILL of the process, and the lines of several processes sharing one file never interleave.
Owned by the training thread; the file closes with the object.
"""
from __future__ import annotations

import io


class BatchLog:
    """Where the batches of ``stream`` trained on are logged (``path`` empty: nowhere)."""

    def __init__(self, path: str, stream: int) -> None:
        self._stream = stream
        self._file: io.FileIO | None = io.FileIO(path, "ab") if path else None

    def trained(self, index: int) -> None:
        """Batch ``index`` of the stream gets an inner step."""
        if self._file is not None:
            self._file.write(f"{self._stream} {index}\n".encode())
